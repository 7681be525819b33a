//! The bracket of the search, `(l, h)`: `l` rows ran, `h` did not. When it is settled, and how
//! many bisection runs settle it.

/// The bracket `(l, h)` (l ran, h did not) pins the maximum, which lies in `l..h`: `l` is at
/// least [`TOLERANCE`] of `h - 1`.
pub(super) fn settled(l: usize, h: usize) -> bool {
    h <= l.saturating_add(1) || l as f64 >= TOLERANCE * (h - 1) as f64
}

/// The largest `h` for which `(l, h)` is settled: a failure there ends the search.
pub(super) fn settle_above(l: usize) -> usize {
    let mut h = ((l as f64 / TOLERANCE).floor() as usize).saturating_add(1);
    while h > l.saturating_add(1) && !settled(l, h) {
        h -= 1;
    }
    while h < usize::MAX && settled(l, h + 1) {
        h += 1;
    }
    h.max(l.saturating_add(1))
}

/// The smallest `l` for which `(l, h)` is settled: a success there ends the search.
fn settle_below(h: usize) -> usize {
    let mut l = (TOLERANCE * h.saturating_sub(1) as f64).ceil() as usize;
    while l > 0 && settled(l - 1, h) {
        l -= 1;
    }
    while !settled(l, h) {
        l += 1;
    }
    l.min(h.saturating_sub(1))
}

/// `settle_above` applied `2^k` times from `l`, stopping at `stop`: with `k` runs, a bisection
/// settles any bracket `(l, h)` with `h` up to this.
pub(super) fn reach_above(l: usize, k: u32, stop: usize) -> usize {
    let mut x = l;
    for _ in 0..(1u64 << k.min(20)) {
        if x >= stop {
            break;
        }
        x = settle_above(x);
    }
    x
}

/// `settle_below` applied `2^k` times from `h`, stopping at `stop`.
pub(super) fn reach_below(h: usize, k: u32, stop: usize) -> usize {
    let mut x = h;
    for _ in 0..(1u64 << k.min(20)) {
        if x <= stop {
            break;
        }
        x = settle_below(x);
    }
    x
}

/// The runs a bisection needs, whatever the memory does, to settle `(l, h)`: the fewest `k`
/// with `reach_above(l, k) >= h`.
pub(super) fn bisection_runs(l: usize, h: usize) -> u32 {
    let mut steps = 0u64;
    let mut x = l;
    while x < h && steps < 1 << 20 {
        x = settle_above(x);
        steps += 1;
    }
    // ceil(log2(steps))
    if steps <= 1 {
        0
    } else {
        64 - (steps - 1).leading_zeros()
    }
}

/// The probe that halves what bisection has left to do in `(l, h)`: as many settling steps
/// ([`settle_above`]) below it as above it.
pub(super) fn bisection_point(l: usize, h: usize) -> usize {
    let mut steps = 0u64;
    let mut x = l;
    while x < h && steps < 1 << 20 {
        x = settle_above(x);
        steps += 1;
    }
    reach_steps(l, steps / 2, h).clamp(l.saturating_add(1), h.saturating_sub(1).max(l + 1))
}

/// `settle_above` applied `n` times from `l`, stopping at `stop`.
fn reach_steps(l: usize, n: u64, stop: usize) -> usize {
    let mut x = l;
    for _ in 0..n {
        if x >= stop {
            break;
        }
        x = settle_above(x);
    }
    x
}

/// The search stops once the largest batch that ran is at least this fraction of the largest
/// batch below the smallest one that did not (the maximum lies between the two).
pub const TOLERANCE: f64 = 0.95;
