//! The predictive batch finder on simulated models whose memory is linear in the batch: at least
//! 95% of the true maximum in at most 4 step runs.

use oomguard_runtime::backend::sim::SimDevice;
use oomguard_runtime::retry::{find_max_batch, FinderError, FinderOptions};
use oomguard_runtime::{AllocatorConfig, ByteSize, Device, Error};

const MIB: u64 = 1 << 20;

struct Model {
    capacity: ByteSize,
    params: u64,
    layers: usize,
    act_per_row: u64,
    workspace: u64,
}

impl Model {
    fn device(&self) -> (Device, oomguard_runtime::DeviceBuffer<u8>) {
        let dev = Device::new(
            SimDevice::address_only(self.capacity),
            AllocatorConfig::default(),
        );
        let weights = dev.alloc::<u8>(self.params as usize).unwrap();
        (dev, weights)
    }
    /// Forward keeps every layer's activations for backward; backward needs gradients and a
    /// workspace.
    fn step(&self, dev: &Device, rows: usize) -> Result<(), Error> {
        let mut acts = Vec::with_capacity(self.layers);
        for _ in 0..self.layers {
            acts.push(dev.alloc::<u8>((self.act_per_row * rows as u64) as usize)?);
        }
        let _grads = dev.alloc::<u8>(self.params as usize)?;
        let _ws = dev.alloc::<u8>(self.workspace as usize)?;
        Ok(())
    }
    fn true_max(&self, dev: &Device) -> usize {
        let (mut lo, mut hi) = (0usize, 1usize);
        while self.step(dev, hi).is_ok() {
            lo = hi;
            hi *= 2;
        }
        while hi - lo > 1 {
            let mid = (lo + hi) / 2;
            if self.step(dev, mid).is_ok() {
                lo = mid
            } else {
                hi = mid
            }
        }
        lo
    }
}

fn models() -> Vec<(&'static str, Model)> {
    vec![
        (
            "gpt2-like",
            Model {
                capacity: ByteSize::gib(80),
                params: 1024 * MIB,
                layers: 12,
                act_per_row: 60 * MIB,
                workspace: 512 * MIB,
            },
        ),
        (
            "resnet-like",
            Model {
                capacity: ByteSize::gib(24),
                params: 100 * MIB,
                layers: 50,
                act_per_row: 600 << 10,
                workspace: 64 * MIB,
            },
        ),
        (
            "mlp-like",
            Model {
                capacity: ByteSize::gib(8),
                params: 200 * MIB,
                layers: 4,
                act_per_row: 400 << 10,
                workspace: 8 * MIB,
            },
        ),
    ]
}

#[test]
fn finds_95_percent_in_4_runs() {
    for (name, m) in models() {
        let (dev, _weights) = m.device();
        let truth = m.true_max(&dev);
        let report =
            find_max_batch(&dev, FinderOptions::default(), |rows| m.step(&dev, rows)).unwrap();
        let ratio = report.max_batch as f64 / truth as f64;
        println!("{name}: true {truth}, {report}");
        assert!(report.max_batch <= truth, "{name}: {report}");
        assert!(ratio >= 0.95, "{name}: {ratio:.3} of {truth}: {report}");
        assert!(report.runs() <= 4, "{name}: {report}");
        let fit = report.fit.expect("a fit");
        let per_row = (m.layers as u64 * m.act_per_row) as f64;
        assert!(
            (fit.per_row_bytes / per_row - 1.0).abs() < 0.01,
            "{name}: {fit:?}"
        );
        // the device is left as found
        assert_eq!(
            dev.stats().allocated_bytes.all.current,
            m.params.next_multiple_of(512)
        );
    }
}

#[test]
fn bisects_when_the_prediction_fails() {
    // Memory jumps past 300 rows (a different kernel takes a large workspace): the linear fit
    // overshoots, and the finder bisects down to the real limit.
    let dev = Device::sim(ByteSize::mib(1024));
    let step = |rows: usize| -> Result<(), Error> {
        let _a = dev.alloc::<u8>(rows * (1 << 20))?;
        let _ws = dev.alloc::<u8>(if rows > 300 { 900 << 20 } else { 1 << 20 })?;
        Ok(())
    };
    let r = find_max_batch(&dev, FinderOptions::default(), step).unwrap();
    assert!(r.trials.iter().any(|t| t.peak_bytes.is_none()), "{r}");
    // within the finder's 5% of the limit, never above it
    assert!((285..=300).contains(&r.max_batch), "{r}");
    assert!(step(r.max_batch).is_ok());
}

#[test]
fn errors_are_reported() {
    let dev = Device::sim(ByteSize::mib(64));
    let nothing = find_max_batch(&dev, FinderOptions::default(), |_| {
        dev.alloc::<u8>(128 << 20).map(|_| ())
    })
    .unwrap_err();
    assert!(matches!(nothing, FinderError::NothingFits(_)), "{nothing}");
    let bad = FinderOptions {
        start: 0,
        ..FinderOptions::default()
    };
    let e = find_max_batch(&dev, bad, |_| Ok::<_, Error>(())).unwrap_err();
    assert!(e.to_string().contains("start 0"), "{e}");
    let e = find_max_batch(&dev, FinderOptions::default(), |_| {
        Err::<(), _>(Error::InvalidArgument("shape".into()))
    })
    .unwrap_err();
    assert!(matches!(e, FinderError::Step(_)), "{e}");
}
