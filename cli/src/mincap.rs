//! The smallest device capacity on which a trace replays without a failure, by bisection.

use oomguard_runtime::{AllocatorConfig, ByteSize};
use serde::Serialize;

use crate::event::Trace;
use crate::replay::{replay, ReplayOptions};

/// Largest capacity tried before giving up (1 PiB).
pub const MAX_CAPACITY: u64 = 1 << 50;

/// The result of [`min_capacity`].
#[derive(Clone, Debug, Serialize)]
pub struct MinCapacity {
    /// The smallest capacity found on which the replay completes.
    pub min_capacity_bytes: u64,
    /// The largest capacity found on which it fails (`min_capacity_bytes` is within the
    /// tolerance of it); `None` when the trace's own peak live bytes suffice.
    pub max_failing_bytes: Option<u64>,
    /// The trace's peak live bytes (the floor).
    pub peak_live_bytes: u64,
    /// `min_capacity_bytes / peak_live_bytes`.
    pub ratio: f64,
    /// Replays run.
    pub replays: u32,
    /// The configuration, in `OOMGUARD_ALLOC_CONF` syntax.
    pub config: String,
}

/// No capacity up to [`MAX_CAPACITY`] completes the replay.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("the replay fails even with {} of device memory: {message}", ByteSize(*capacity))]
pub struct NoCapacity {
    /// The largest capacity tried.
    pub capacity: u64,
    /// The first failure's message there.
    pub message: String,
}

/// Bisects the device capacity between the trace's peak live bytes and a capacity that works,
/// until the gap between the largest failing and the smallest working capacity is at most
/// `tolerance` (a fraction, e.g. 0.001) of the latter. Replays are deterministic, so the answer is
/// too; it assumes that more capacity never hurts, which holds for this allocator up to the
/// capacity-dependent size of growable address ranges.
///
/// ```
/// use oomguard_cli::{mincap::min_capacity, Event, Trace, TraceFormat};
/// use oomguard_runtime::AllocatorConfig;
/// let t = Trace::new(TraceFormat::Csv, vec![Event::alloc(0, 50 << 20, 0), Event::free(0, 50 << 20, 0)]);
/// let m = min_capacity(&t, &AllocatorConfig::default(), 0.001).unwrap();
/// assert!(m.min_capacity_bytes >= 50 << 20 && m.min_capacity_bytes <= 52 << 20);
/// ```
pub fn min_capacity(
    trace: &Trace,
    config: &AllocatorConfig,
    tolerance: f64,
) -> Result<MinCapacity, NoCapacity> {
    let peak_live = trace.peak_live_bytes();
    let mut replays = 0u32;
    let mut try_cap = |capacity: u64| {
        replays += 1;
        let opts = ReplayOptions {
            config: config.clone(),
            capacity,
            stop_at_first_failure: true,
            timeline: false,
        };
        let (r, _) = replay(trace, &opts, &mut |_| {});
        (
            r.completed,
            r.peak_reserved_bytes,
            r.failures.first().map(|f| f.message.clone()),
        )
    };
    let floor = peak_live.max(1);
    let result = |min: u64, fail: Option<u64>, replays: u32| MinCapacity {
        min_capacity_bytes: min,
        max_failing_bytes: fail,
        peak_live_bytes: peak_live,
        ratio: if peak_live == 0 {
            0.0
        } else {
            min as f64 / peak_live as f64
        },
        replays,
        config: config.to_string(),
    };
    let (ok, _, _) = try_cap(floor);
    if ok {
        return Ok(result(floor, None, replays));
    }
    let mut lo = floor; // fails
                        // Start from what an unconstrained replay reserves.
    let (_, reserved, _) = try_cap(crate::replay::DEFAULT_CAPACITY.max(floor.saturating_mul(2)));
    let mut hi = reserved.max(lo + 1);
    loop {
        let (ok, _, msg) = try_cap(hi);
        if ok {
            break;
        }
        lo = hi;
        if hi >= MAX_CAPACITY {
            return Err(NoCapacity {
                capacity: hi,
                message: msg.unwrap_or_default(),
            });
        }
        hi = hi.saturating_mul(2).min(MAX_CAPACITY);
    }
    while (hi - lo) as f64 > tolerance * hi as f64 && hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if try_cap(mid).0 {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    Ok(result(hi, Some(lo), replays))
}
