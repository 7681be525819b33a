//! The guard attributes on the simulated device: `#[no_grad]`, `#[memory_budget]`,
//! `#[leak_check]` — each attribute's effect, restoration after panics, and async bodies.

use std::future::Future;
use std::panic::catch_unwind;
use std::pin::pin;
use std::task::{Context, Poll, Waker};

use oomguard::{
    is_grad_enabled, leak_check, memory_budget, no_grad, oom_retry, ByteSize, Device, Error,
};

#[no_grad]
fn grad_inside() -> bool {
    is_grad_enabled()
}

#[no_grad]
fn panics_without_grad() {
    assert!(!is_grad_enabled());
    panic!("boom");
}

#[test]
fn no_grad_turns_grad_off_inside_and_restores_it_also_on_panic() {
    assert!(is_grad_enabled());
    assert!(!grad_inside());
    assert!(is_grad_enabled());
    assert!(catch_unwind(panics_without_grad).is_err());
    assert!(is_grad_enabled(), "restored after the panic");
}

#[memory_budget("1 MiB")]
fn allocate_within(dev: &Device, bytes: usize) -> Result<usize, Error> {
    let b = dev.alloc::<u8>(bytes)?;
    Ok(b.len())
}

#[memory_budget(bytes = 2 * (1 << 20))]
fn allocate_two(dev: &Device, bytes: usize) -> Result<(), Error> {
    let _a = dev.alloc::<u8>(bytes)?;
    let _b = dev.alloc::<u8>(bytes)?;
    Ok(())
}

#[memory_budget(fraction = 0.25)]
fn allocate_fraction(dev: &Device, bytes: usize) -> Result<(), Error> {
    dev.alloc::<u8>(bytes).map(drop)
}

#[test]
fn memory_budget_refuses_what_exceeds_it_and_only_inside() {
    let dev = Device::sim(ByteSize::gib(1));
    assert_eq!(
        allocate_within(&dev, 1 << 20).unwrap(),
        1 << 20,
        "exactly the budget fits"
    );
    let e = allocate_within(&dev, (1 << 20) + 1).unwrap_err();
    assert!(matches!(e, Error::BudgetExceeded(_)), "{e}");
    assert!(e.is_oom());
    // outside the function no budget applies
    drop(dev.alloc::<u8>(100 << 20).unwrap());
    assert!(allocate_two(&dev, 1 << 20).is_ok());
    assert!(allocate_two(&dev, (1 << 20) + 512).is_err());
    assert!(
        allocate_fraction(&dev, 256 << 20).is_ok(),
        "a quarter of 1 GiB fits"
    );
    assert!(allocate_fraction(&dev, (256 << 20) + 1).is_err());
    assert_eq!(dev.stats().allocated_bytes.all.current, 0);
}

/// A `#[memory_budget]`'s refusal names the function's file as where its budget was opened.
#[test]
fn a_memory_budget_refusal_names_the_functions_file() {
    let dev = Device::sim(ByteSize::gib(1));
    let Error::BudgetExceeded(b) = allocate_within(&dev, 2 << 20).unwrap_err() else {
        panic!("not a budget's refusal")
    };
    let at = b.opened_at.expect("the budget's site");
    assert_eq!(at.file(), file!(), "{b}");
    assert!(
        b.to_string()
            .contains("(the budget opened at tests/macros_guards.rs:"),
        "{b}"
    );
}

#[leak_check(action = error, allow = "1 KiB")]
fn keeps(dev: &Device, keep: &mut Vec<oomguard::DeviceBuffer<u8>>, n: usize) -> Result<(), Error> {
    keep.push(dev.alloc::<u8>(n)?);
    Ok(())
}

#[leak_check]
fn leaks_and_panics(dev: &Device, keep: &mut Vec<oomguard::DeviceBuffer<u8>>) {
    keep.push(dev.alloc::<u8>(4096).unwrap());
}

#[leak_check(action = warn)]
fn leaks_and_warns(dev: &Device, keep: &mut Vec<oomguard::DeviceBuffer<u8>>) {
    keep.push(dev.alloc::<u8>(4096).unwrap());
}

#[leak_check]
fn frees_everything(dev: &Device) -> usize {
    let a = dev.alloc::<u8>(1 << 20).unwrap();
    a.len()
}

#[test]
fn leak_check_reports_leaks_with_the_allocating_line() {
    let dev = Device::sim(ByteSize::gib(1));
    let mut keep = Vec::new();
    assert!(keeps(&dev, &mut keep, 1000).is_ok(), "within the allowance");
    let e = keeps(&dev, &mut keep, 1 << 20).unwrap_err();
    let Error::Leak(report) = &e else {
        panic!("{e}")
    };
    assert_eq!(report.leaks.len(), 1);
    assert!(report.leaks[0]
        .location
        .file()
        .ends_with("macros_guards.rs"));
    let msg = catch_unwind(std::panic::AssertUnwindSafe(|| {
        leaks_and_panics(&dev, &mut keep)
    }))
    .unwrap_err();
    let msg = msg.downcast_ref::<String>().unwrap();
    assert!(msg.contains("still live"), "{msg}");
    leaks_and_warns(&dev, &mut keep);
    assert_eq!(frees_everything(&dev), 1 << 20);
    drop(keep);
    assert_eq!(dev.stats().allocated_bytes.all.current, 0);
}

#[no_grad]
#[memory_budget("1 MiB")]
async fn async_step(dev: Device, bytes: usize) -> Result<bool, Error> {
    let grad = is_grad_enabled();
    Yield(false).await;
    let b = dev.alloc::<u8>(bytes)?;
    Yield(false).await;
    drop(b);
    Ok(grad || is_grad_enabled())
}

/// Returns Pending once, then Ready.
struct Yield(bool);
impl Future for Yield {
    type Output = ();
    fn poll(mut self: std::pin::Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        if self.0 {
            Poll::Ready(())
        } else {
            self.0 = true;
            cx.waker().wake_by_ref();
            Poll::Pending
        }
    }
}

fn block_on<F: Future>(f: F) -> F::Output {
    let mut f = pin!(f);
    let mut cx = Context::from_waker(Waker::noop());
    loop {
        if let Poll::Ready(v) = f.as_mut().poll(&mut cx) {
            return v;
        }
    }
}

#[test]
fn async_guards_apply_per_poll_only() {
    let dev = Device::sim(ByteSize::gib(1));
    // two tasks interleaved on one thread: the guards of one never leak to the other
    let mut a = pin!(async_step(dev.clone(), 1 << 20));
    let mut cx = Context::from_waker(Waker::noop());
    assert!(a.as_mut().poll(&mut cx).is_pending());
    // between polls of the guarded task: grad on, no budget
    assert!(is_grad_enabled());
    drop(dev.alloc::<u8>(64 << 20).unwrap());
    let out = loop {
        if let Poll::Ready(v) = a.as_mut().poll(&mut cx) {
            break v;
        }
        assert!(is_grad_enabled());
    };
    assert!(!out.unwrap(), "grad was off inside every poll");
    assert!(block_on(async_step(dev.clone(), (1 << 20) + 1))
        .unwrap_err()
        .is_oom());
    assert!(is_grad_enabled());
    assert_eq!(dev.stats().allocated_bytes.all.current, 0);
}

#[oom_retry]
#[memory_budget("1 MiB")]
#[leak_check(action = error, allow = "1 KiB")]
fn budgeted_and_checked(
    dev: &Device,
    keep: &mut Vec<oomguard::DeviceBuffer<u8>>,
    scratch: usize,
    kept: usize,
) -> Result<(), Error> {
    let s = dev.alloc::<u8>(scratch)?;
    keep.push(dev.alloc::<u8>(kept)?);
    drop(s);
    Ok(())
}

#[leak_check]
#[memory_budget(fraction = 0.25)]
#[oom_retry]
fn fraction_and_checked(dev: &Device, bytes: usize) -> Result<usize, Error> {
    let a = dev.alloc::<u8>(bytes)?;
    Ok(a.len())
}

/// `#[memory_budget]` and `#[leak_check]` under `#[oom_retry]` share one scope (the attempt's):
/// both must still act, each on exactly the function's allocations.
#[test]
fn budget_and_leak_check_on_one_function_both_act() {
    let dev = Device::sim(ByteSize::gib(1));
    let mut keep = Vec::new();
    // Allocations before the call count for neither.
    let before = dev.alloc::<u8>(8 << 20).unwrap();
    assert!(budgeted_and_checked(&dev, &mut keep, 512 << 10, 512).is_ok());
    // The budget counts what is live inside: 512 KiB scratch + 600 KiB kept > 1 MiB.
    let e = budgeted_and_checked(&dev, &mut keep, 512 << 10, 600 << 10).unwrap_err();
    let Error::RetriesExhausted { error, report } = &e else {
        panic!("{e}")
    };
    assert!(
        matches!(**error, Error::BudgetExceeded(ref b) if b.limit == 1 << 20),
        "{e}"
    );
    assert_eq!(report.attempts.len(), 1, "a budget is not retried: {e}");
    // Within the budget, a kept buffer over the allowance is a leak naming the function.
    let e = budgeted_and_checked(&dev, &mut keep, 4096, 4096).unwrap_err();
    let Error::Leak(report) = &e else {
        panic!("{e}")
    };
    assert_eq!(report.function, Some("budgeted_and_checked"));
    assert_eq!(report.leaks.len(), 1);
    assert_eq!(report.total_bytes, 4096);
    // The refused call kept nothing.
    assert_eq!(keep.len(), 2);
    assert!(fraction_and_checked(&dev, 256 << 20).is_ok());
    assert!(fraction_and_checked(&dev, (256 << 20) + 1).is_err());
    drop((keep, before));
    assert_eq!(dev.stats().allocated_bytes.all.current, 0);
}

/// Under `#[oom_retry]`, with `#[leak_check]` on the same function (one scope for both), a
/// budget's refusal still names the function's file as where its budget was opened.
#[test]
fn a_retried_budget_refusal_names_the_functions_file() {
    let dev = Device::sim(ByteSize::gib(1));
    let mut keep = Vec::new();
    let e = budgeted_and_checked(&dev, &mut keep, 2 << 20, 512).unwrap_err();
    let Error::RetriesExhausted { error, .. } = &e else {
        panic!("{e}")
    };
    let Error::BudgetExceeded(b) = &**error else {
        panic!("{e}")
    };
    assert_eq!(b.opened_at.map(|a| a.file()), Some(file!()), "{e}");
    let e = fraction_and_checked(&dev, (256 << 20) + 1).unwrap_err();
    let Error::RetriesExhausted { error, .. } = &e else {
        panic!("{e}")
    };
    let Error::BudgetExceeded(b) = &**error else {
        panic!("{e}")
    };
    assert_eq!(b.opened_at.map(|a| a.file()), Some(file!()), "{e}");
}

/// An async `#[memory_budget]` function's refusal names its file too (the budget is opened at
/// each poll, from where the attribute is).
#[test]
fn an_async_budget_refusal_names_the_functions_file() {
    let dev = Device::sim(ByteSize::gib(1));
    let e = block_on(async_step(dev, 2 << 20)).unwrap_err();
    let Error::BudgetExceeded(b) = &e else {
        panic!("{e}")
    };
    assert_eq!(b.opened_at.map(|a| a.file()), Some(file!()), "{e}");
}
