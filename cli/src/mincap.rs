//! The smallest device capacity on which a trace replays without a failure, by bisection.

use oomguard_runtime::{AllocatorConfig, ByteSize};
use serde::Serialize;

use crate::device::DeviceSpec;
use crate::event::Trace;
use crate::replay::{replay, ReplayOptions};

/// Largest capacity tried, and the most a trace may need (1 TiB). No accelerator has more than a
/// third of it (288 GB), and a replay's cost grows with the pages it maps: a single 1 TiB request
/// takes about a second to replay in a debug build, a 1 PiB one twenty minutes. A trace that needs
/// more live bytes than this is refused before anything is replayed.
pub const MAX_CAPACITY: u64 = 1 << 40;

/// The result of [`min_capacity`].
#[derive(Clone, Debug, Serialize)]
pub struct MinCapacity {
    /// The smallest capacity the bisection found on which the replay completes (a smaller one
    /// may complete too: see [`min_capacity`]).
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

/// Why [`min_capacity`] found no answer.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum NoCapacity {
    /// The trace holds more bytes live at once than [`MAX_CAPACITY`]: refused before any replay.
    #[error(
        "the trace holds {} live at once ({peak_live} bytes), more than the {} the search \
         goes up to: no device has that much memory",
        ByteSize(*peak_live),
        ByteSize(MAX_CAPACITY)
    )]
    TooLarge {
        /// The trace's peak live bytes.
        peak_live: u64,
    },
    /// No capacity up to [`MAX_CAPACITY`] completes the replay.
    #[error("the replay fails even with {} of device memory: {message}", ByteSize(*capacity))]
    Fails {
        /// The largest capacity tried.
        capacity: u64,
        /// The first failure's message there.
        message: String,
    },
}

/// Where a [`min_capacity_with_progress`] search stands, after each replay.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Progress {
    /// Replays run so far.
    pub replays: u32,
    /// The largest capacity known to fail (the floor until one is found).
    pub lo: u64,
    /// The smallest capacity known to work (`None` until one is found).
    pub hi: Option<u64>,
}

/// Bisects the device capacity between the trace's peak live bytes and a capacity that works,
/// until the gap between the largest failing and the smallest working capacity is at most
/// `tolerance` (a fraction, e.g. 0.001) of the latter. Replays are deterministic, so the answer is
/// too. The answer is a capacity that fits with one failing within `tolerance` below it, not
/// always the smallest that fits: a replay is not monotone in the capacity (the size of
/// growable address ranges and the memory limit depend on it), and `traces/gpt2.trace.csv`,
/// found at 8,240,575,527 bytes with 8,235,031,309 failing, also fits at 8,227,353,288 (and
/// fails from 8,229 to 8,234 MB).
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
    min_capacity_with_progress(trace, config, tolerance, &mut |_| {})
}

/// [`min_capacity`], calling `progress` after every replay (for a progress bar).
///
/// ```
/// use oomguard_cli::{mincap::{min_capacity_with_progress, NoCapacity}, Event, Trace, TraceFormat};
/// use oomguard_runtime::AllocatorConfig;
/// // 2^63 bytes live: refused at once, nothing replayed
/// let t = Trace::new(TraceFormat::Csv, vec![Event::alloc(0, 1 << 63, 0)]);
/// let mut calls = 0;
/// let e = min_capacity_with_progress(&t, &AllocatorConfig::default(), 0.001, &mut |_| calls += 1);
/// assert!(matches!(e, Err(NoCapacity::TooLarge { .. })));
/// assert_eq!(calls, 0);
/// ```
pub fn min_capacity_with_progress(
    trace: &Trace,
    config: &AllocatorConfig,
    tolerance: f64,
    progress: &mut dyn FnMut(Progress),
) -> Result<MinCapacity, NoCapacity> {
    min_capacity_on(trace, config, &DeviceSpec::Sim, tolerance, progress)
}

/// [`min_capacity_with_progress`] on `device`: on a GPU each replay runs under a memory limit of
/// the capacity tried (see [`crate::device`]).
pub fn min_capacity_on(
    trace: &Trace,
    config: &AllocatorConfig,
    device: &DeviceSpec,
    tolerance: f64,
    progress: &mut dyn FnMut(Progress),
) -> Result<MinCapacity, NoCapacity> {
    let peak_live = trace.peak_live_bytes();
    // Bound first: the floor itself is replayed next, and a replay's cost grows with capacity.
    if peak_live > MAX_CAPACITY {
        return Err(NoCapacity::TooLarge { peak_live });
    }
    let mut replays = 0u32;
    let mut try_cap = |capacity: u64| {
        replays += 1;
        let opts = ReplayOptions {
            config: config.clone(),
            capacity,
            stop_at_first_failure: true,
            timeline: false,
            device: device.clone(),
            page_size: None,
            steps: None,
            threads: false,
        };
        let (r, _) = replay(trace, &opts, &mut |_| {});
        (
            r.completed,
            r.peak_reserved_bytes,
            r.failures.first().map(|f| f.message.clone()),
            replays,
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
    let (ok, _, _, n) = try_cap(floor);
    progress(Progress {
        replays: n,
        lo: floor,
        hi: ok.then_some(floor),
    });
    if ok {
        return Ok(result(floor, None, n));
    }
    let mut lo = floor; // fails
                        // Start from what an unconstrained replay reserves.
    let start = crate::replay::DEFAULT_CAPACITY
        .max(floor.saturating_mul(2))
        .min(MAX_CAPACITY);
    let (_, reserved, _, mut n) = try_cap(start);
    progress(Progress {
        replays: n,
        lo,
        hi: None,
    });
    let mut hi = reserved.max(lo + 1).min(MAX_CAPACITY);
    loop {
        let (ok, _, msg, m) = try_cap(hi);
        n = m;
        progress(Progress {
            replays: m,
            lo: if ok { lo } else { hi },
            hi: ok.then_some(hi),
        });
        if ok {
            break;
        }
        lo = hi;
        if hi >= MAX_CAPACITY {
            return Err(NoCapacity::Fails {
                capacity: hi,
                message: msg.unwrap_or_default(),
            });
        }
        hi = hi.saturating_mul(2).min(MAX_CAPACITY);
    }
    let mut replays = n;
    while (hi - lo) as f64 > tolerance * hi as f64 && hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        let (ok, _, _, n) = try_cap(mid);
        replays = n;
        if ok {
            hi = mid;
        } else {
            lo = mid;
        }
        progress(Progress {
            replays: n,
            lo,
            hi: Some(hi),
        });
    }
    Ok(result(hi, Some(lo), replays))
}
