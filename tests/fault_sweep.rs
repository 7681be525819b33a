//! Fault-injection sweep over the quickstart's step: an out-of-memory injected at every
//! allocation index; each run either completes with the same result as the fault-free run or
//! fails with a clean OOM error, and afterwards no buffer is left allocated and the allocator's
//! invariants hold.

use oomguard::backend::sim::SimDevice;
use oomguard::{AllocatorConfig, ByteSize, Device, Error};

/// The quickstart's work: weights, activations, a reduction, some temporaries.
fn step(dev: &Device) -> Result<f32, Error> {
    let weights = dev.from_slice(&vec![0.5f32; 1 << 14])?;
    let mut acc = 0.0f32;
    for layer in 0..6usize {
        let act = dev.zeros::<f32>((layer + 1) << 12)?;
        let tmp = dev.from_slice(&vec![layer as f32; 1 << 10])?;
        acc += tmp.to_vec()?.iter().sum::<f32>() + act.len() as f32;
    }
    acc += weights.to_vec()?[0];
    Ok(acc)
}

#[test]
fn an_oom_at_every_allocation_index_fails_cleanly_or_completes_identically() {
    for cfg in ["expandable_segments:True", "expandable_segments:False"] {
        let sim = SimDevice::new(ByteSize::gib(1));
        let dev = Device::new(sim.clone(), AllocatorConfig::parse(cfg).unwrap());
        let before = sim.faults().requests_seen();
        let expected = step(&dev).unwrap();
        let n = sim.faults().requests_seen() - before;
        assert!(n >= 13, "the step allocates {n} times");
        for k in 0..n {
            sim.faults().fail_nth_request(k);
            match step(&dev) {
                Ok(v) => panic!("{cfg}: fault at {k} did not fire (got {v})"),
                Err(e) => assert!(e.is_oom(), "{cfg}: fault at {k}: {e}"),
            }
            let s = dev.stats();
            assert_eq!(
                s.allocated_bytes.all.current, 0,
                "{cfg}: fault at {k} leaked"
            );
            dev.allocator().check_invariants().unwrap();
            // the same step right after succeeds with the same result
            assert_eq!(step(&dev).unwrap(), expected);
        }
        sim.faults().clear();
    }
}
