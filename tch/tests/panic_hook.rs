//! The panic hook and the out-of-memory panics `train_step` and `find_max_batch` handle: a
//! plain tch method's out-of-memory that they catch prints nothing (no hook output, no C++
//! frames, no Rust backtrace), while every other panic prints as before. Checked on what a
//! child process (this test binary again, `RUST_BACKTRACE=1`) writes to its stderr between
//! markers.

use std::panic;
use std::process::Command;

use oomguard::retry::{FinderOptions, RetryEngine};
use oomguard::ByteSize;
use oomguard_tch::{find_max_batch, train_step, Error};
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

/// Set in the child: run the scenario instead of spawning.
const CHILD: &str = "OOMGUARD_TCH_PANIC_HOOK_CHILD";

/// 4 PiB on the CPU: libtorch's allocator fails with ENOMEM; the plain method panics.
fn plain_oom() -> Tensor {
    Tensor::empty([1i64 << 50], (Kind::Float, Device::Cpu))
}

/// A plain tch method's shape error: a panic that is not an out-of-memory.
fn plain_shape_error() -> Tensor {
    let a = Tensor::zeros([2, 3], (Kind::Float, Device::Cpu));
    a.matmul(&Tensor::zeros([4, 5], (Kind::Float, Device::Cpu)))
}

/// What the scenario does, section by section, each between `BEGIN name` / `END name` lines
/// on stderr.
fn scenario() {
    let section = |name: &str, f: &mut dyn FnMut()| {
        eprintln!("BEGIN {name}");
        f();
        eprintln!("END {name}");
    };
    let vs = nn::VarStore::new(Device::Cpu);
    let model = nn::linear(vs.root(), 4, 1, Default::default());
    let mut sgd = nn::Sgd::default().build(&vs, 0.01).unwrap();
    let x = Tensor::ones([64, 4], (Kind::Float, Device::Cpu));
    let card = oomguard::Device::sim(ByteSize::gib(1));
    section("train_step_oom", &mut || {
        // out of memory above 16 rows, as a plain method's panic: caught and retried
        let done = train_step(
            &RetryEngine::new(),
            &card,
            &[&x],
            &vs,
            &mut sgd,
            |c, rows| {
                if c.len() > 16 {
                    let _huge = plain_oom();
                }
                Ok(model.forward(&rows[0]).f_square()?.f_mean(Kind::Float)?)
            },
        )
        .unwrap();
        assert!(done.report.retries() >= 2, "{}", done.report);
    });
    section("find_max_batch_oom", &mut || {
        let found = find_max_batch(&card, FinderOptions::default(), |rows| {
            let _acts = card.alloc::<u8>(rows << 20)?;
            if rows > 100 {
                let _huge = plain_oom();
            }
            Ok::<_, Error>(rows)
        })
        .unwrap();
        assert!(found.max_batch <= 100, "{found}");
    });
    section("train_step_shape_error", &mut || {
        // not an out-of-memory: the step fails, and the panic printed as any panic
        let r = train_step(&RetryEngine::new(), &card, &[&x], &vs, &mut sgd, |_, _| {
            Ok(plain_shape_error())
        });
        assert!(r.is_err());
    });
    section("plain_oom_outside", &mut || {
        // outside train_step and find_max_batch: printed as any panic
        assert!(panic::catch_unwind(plain_oom).is_err());
    });
    section("other_panic_after", &mut || {
        assert!(panic::catch_unwind(|| panic!("a bug of the user's")).is_err());
    });
}

/// The stderr lines between `BEGIN name` and `END name`.
fn section<'a>(stderr: &'a str, name: &str) -> Vec<&'a str> {
    let begin = format!("BEGIN {name}");
    let end = format!("END {name}");
    let mut lines = stderr.lines().skip_while(|l| *l != begin);
    assert_eq!(lines.next(), Some(begin.as_str()), "{name} ran:\n{stderr}");
    let inside: Vec<&str> = lines.by_ref().take_while(|l| *l != end).collect();
    inside
}

#[test]
fn caught_ooms_print_nothing_and_other_panics_print() {
    if std::env::var_os(CHILD).is_some() {
        scenario();
        return;
    }
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "caught_ooms_print_nothing_and_other_panics_print",
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .env(CHILD, "1")
        .env("RUST_BACKTRACE", "1")
        .output()
        .expect("the test binary runs again");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "the child failed:\n{stderr}");
    for quiet in ["train_step_oom", "find_max_batch_oom"] {
        let lines = section(&stderr, quiet);
        assert!(
            lines.is_empty(),
            "{quiet}: {} lines printed for handled out-of-memory panics:\n{}",
            lines.len(),
            lines.join("\n")
        );
    }
    for (loud, what) in [
        (
            "train_step_shape_error",
            "mat1 and mat2 shapes cannot be multiplied",
        ),
        (
            "plain_oom_outside",
            "DefaultCPUAllocator: can't allocate memory",
        ),
        ("other_panic_after", "a bug of the user's"),
    ] {
        let text = section(&stderr, loud).join("\n");
        assert!(
            text.contains("panicked at") && text.contains(what),
            "{loud} prints its panic:\n{text}"
        );
        assert!(text.contains("stack backtrace"), "{loud}: {text}");
    }
}
