//! What `#[oom_retry]` remembers, and under which key (issue 15, points 5 and 6): the device's
//! identity and capacity, the generic instance, the grad mode inside the function; plans can be
//! listed and forgotten; a batch cap read from a plan file never truncates a training step.

use oomguard::retry::{last_report, DeviceKey, Limits, MemoryKey, PlanMemory, StepMode};
use oomguard::{no_grad, oom_retry, BatchPlan, ByteSize, Device, Error};

const MIB: usize = 1 << 20;

#[oom_retry(plan = plan)]
fn step(dev: &Device, plan: &BatchPlan) -> Result<usize, Error> {
    let mut n = 0;
    for c in plan.chunks() {
        n += dev.alloc::<u8>(c.len() * MIB)?.len() / MIB;
    }
    Ok(n)
}

#[test]
fn a_plan_learned_on_a_small_card_does_not_apply_to_a_large_one() {
    let small = Device::sim(ByteSize::mib(64));
    let plan = BatchPlan::whole(100).unwrap();
    assert_eq!(step(&small, &plan).unwrap(), 100);
    let learned = last_report().unwrap();
    assert!(learned.final_plan.num_chunks() > 1);
    let mine = oomguard::remembered_plans()
        .into_iter()
        .find(|p| p.key.site.ends_with(" step"))
        .expect("listed");
    assert_eq!(mine.key.device, DeviceKey::of(&small));
    assert_eq!(mine.key.device.total_bytes, 64 << 20);

    // The model lives on the large card (allocated there before the step).
    let large = Device::sim(ByteSize::gib(4));
    let _weights = large.alloc::<u8>(MIB).unwrap();
    assert_eq!(step(&large, &plan).unwrap(), 100);
    let r = last_report().unwrap();
    assert!(!r.from_memory, "{r}");
    assert_eq!(r.final_plan.num_chunks(), 1, "{r}");
    // and the small card's plan is still there
    let _x = small.alloc::<u8>(1).unwrap();
    drop(_x);
    step(&small, &plan).unwrap();
    assert!(last_report().unwrap().from_memory);
}

#[oom_retry(plan = plan)]
fn generic_step<T: bytemuck::Pod>(dev: &Device, plan: &BatchPlan) -> Result<usize, Error> {
    let mut n = 0;
    for c in plan.chunks() {
        n += dev.alloc::<T>(c.len() * MIB / 8)?.len();
    }
    Ok(n)
}

#[test]
fn generic_instances_are_remembered_apart() {
    let dev = Device::sim(ByteSize::mib(64));
    let plan = BatchPlan::whole(128).unwrap();
    // u64: 1 MiB a row, 128 MiB: split
    generic_step::<u64>(&dev, &plan).unwrap();
    assert!(last_report().unwrap().retries() > 0);
    // u8: 128 KiB a row, 16 MiB: fits whole, and nothing of u64's applies
    generic_step::<u8>(&dev, &plan).unwrap();
    let r = last_report().unwrap();
    assert!(!r.from_memory, "{r}");
    assert_eq!(r.final_plan.num_chunks(), 1);
    assert!(r.site.ends_with("generic_step<(u8,)>"), "{}", r.site);
}

#[oom_retry(plan = plan)]
#[no_grad]
fn eval_step(dev: &Device, plan: &BatchPlan) -> Result<usize, Error> {
    let mut n = 0;
    for c in plan.chunks() {
        n += dev.alloc::<u8>(c.len() * MIB)?.len() / MIB;
    }
    Ok(n)
}

#[test]
fn the_mode_is_the_one_inside_the_function() {
    let dev = Device::sim(ByteSize::mib(64));
    // the caller trains; #[no_grad] makes the step an evaluation
    assert!(oomguard::is_grad_enabled());
    eval_step(&dev, &BatchPlan::whole(100).unwrap()).unwrap();
    assert_eq!(last_report().unwrap().mode, StepMode::Eval);
}

const PLAN_FILE: &str = "target/oomguard-test-persisted-batch-cap.json";

#[oom_retry(plan = plan, persist = "target/oomguard-test-persisted-batch-cap.json")]
fn persisted_step(dev: &Device, plan: &BatchPlan) -> Result<usize, Error> {
    let mut n = 0;
    for c in plan.chunks() {
        n += dev.alloc::<u8>(c.len() * MIB)?.len() / MIB;
    }
    Ok(n)
}

/// The key `#[oom_retry]` gives `persisted_step`: `file:line name`, the line of its name.
fn persisted_step_site() -> String {
    let line = include_str!("macros_plans.rs")
        .lines()
        .position(|l| l.starts_with("fn persisted_step("))
        .unwrap()
        + 1;
    format!("{}:{line} persisted_step", file!())
}

#[test]
fn a_batch_cap_from_a_plan_file_does_not_truncate_a_training_step() {
    // `target/` of the package directory: absent when CARGO_TARGET_DIR points elsewhere.
    std::fs::create_dir_all("target").unwrap();
    let dev = Device::sim(ByteSize::mib(64));
    let _ = std::fs::remove_file(PLAN_FILE);
    let _weights = dev.alloc::<u8>(MIB).unwrap();
    let key = MemoryKey {
        site: persisted_step_site(),
        device: DeviceKey::of(&dev),
        mode: StepMode::Train,
    };
    let mut file = PlanMemory::open(PLAN_FILE).unwrap();
    file.set_limits(
        &key,
        Limits {
            micro_batch: Some(10),
            batch: Some(10),
        },
    )
    .unwrap();
    drop(file);
    assert_eq!(
        persisted_step(&dev, &BatchPlan::whole(100).unwrap()).unwrap(),
        100
    );
    let r = last_report().unwrap();
    assert!(r.from_memory, "the file's plan was found: {r}");
    assert_eq!(r.final_plan.batch(), 100);
    assert_eq!(r.final_plan.micro_batch(), 10);
    let _ = std::fs::remove_file(PLAN_FILE);
}

#[oom_retry(plan = plan, persist = "target/oomguard-test-corrupt-plans.json")]
fn corrupt_file_step(dev: &Device, plan: &BatchPlan) -> Result<usize, Error> {
    let mut n = 0;
    for c in plan.chunks() {
        n += dev.alloc::<u8>(c.len() * MIB)?.len() / MIB;
    }
    Ok(n)
}

#[test]
fn a_corrupt_plan_file_is_in_every_report() {
    std::fs::create_dir_all("target").unwrap();
    std::fs::write("target/oomguard-test-corrupt-plans.json", "{not json").unwrap();
    let dev = Device::sim(ByteSize::mib(64));
    let plan = BatchPlan::whole(100).unwrap();
    for _ in 0..2 {
        assert_eq!(corrupt_file_step(&dev, &plan).unwrap(), 100);
        let r = last_report().unwrap();
        let m = r.memory_error.as_deref().expect("reported");
        assert!(m.contains("is not valid"), "{m}");
        assert!(r.to_string().contains("plan file:"), "{r}");
    }
    // the plan it learned is remembered in memory only, and remembered_plans says so
    let mine = oomguard::remembered_plans()
        .into_iter()
        .find(|p| p.key.site.ends_with(" corrupt_file_step"))
        .expect("the learned plan is remembered");
    assert_eq!(mine.file, None, "not saved in the corrupt file: {mine:?}");
    let _ = std::fs::remove_file("target/oomguard-test-corrupt-plans.json");
}
