//! Models of a step's peak memory against its rows: the line through two runs ([`LinearFit`]),
//! the parabola through three, the power law through two.

/// `peak = fixed + per_row × rows`, fitted from two runs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LinearFit {
    /// Bytes independent of the batch that the step allocates (gradients, workspace; not what
    /// was allocated before the search, such as the weights).
    pub fixed_bytes: f64,
    /// Bytes per row.
    pub per_row_bytes: f64,
}

impl LinearFit {
    /// The line through `(r1, p1)` and `(r2, p2)`; `None` when it does not grow with rows.
    pub fn through(r1: usize, p1: u64, r2: usize, p2: u64) -> Option<Self> {
        if r2 == r1 {
            return None;
        }
        let per_row = (p2 as f64 - p1 as f64) / (r2 as f64 - r1 as f64);
        (per_row > 0.0).then_some(Self {
            fixed_bytes: p1 as f64 - per_row * r1 as f64,
            per_row_bytes: per_row,
        })
    }
    /// Predicted peak for `rows`.
    pub fn peak(&self, rows: usize) -> f64 {
        self.fixed_bytes + self.per_row_bytes * rows as f64
    }
    /// The most rows whose predicted peak leaves `margin` of the room above the fixed part free
    /// under `budget` bytes.
    pub fn max_rows(&self, budget: u64, margin: f64) -> usize {
        let room = (budget as f64 - self.fixed_bytes).max(0.0) * (1.0 - margin);
        (room / self.per_row_bytes).floor().max(0.0) as usize
    }
}

/// The parabola through three `(rows, peak)` points: `y = y3 + m (x - x3) + k (x - x3)(x - x2)`.
struct Parabola {
    k: f64,
    m: f64,
    x2: f64,
    x3: f64,
    y3: f64,
}

impl Parabola {
    /// The parabola through `a`, `b`, `c` when it is convex; `None` when it is not, or so little
    /// that the points are a line (rounding: the secant then).
    fn through(a: (usize, u64), b: (usize, u64), c: (usize, u64)) -> Option<Self> {
        let (x1, y1, x2, y2, x3, y3) = (
            a.0 as f64, a.1 as f64, b.0 as f64, b.1 as f64, c.0 as f64, c.1 as f64,
        );
        let d1 = (y2 - y1) / (x2 - x1);
        let m = (y3 - y2) / (x3 - x2);
        let k = (m - d1) / (x3 - x1); // the r² coefficient
        if k.is_nan() || !k.is_finite() || k * (x3 - x1) * (x3 - x1) <= 1e-3 * (y3 - y1).abs() {
            return None;
        }
        Some(Self { k, m, x2, x3, y3 })
    }

    /// The peak it predicts at `x` rows.
    fn at(&self, x: f64) -> f64 {
        self.y3 + self.m * (x - self.x3) + self.k * (x - self.x3) * (x - self.x2)
    }
}

/// The largest rows at which the parabola through three `(rows, peak)` points stays under
/// `target`, when it is increasing and convex there.
pub(super) fn quadratic_rows(
    a: (usize, u64),
    b: (usize, u64),
    c: (usize, u64),
    target: f64,
) -> Option<usize> {
    let Parabola { k, m, x2, x3, y3 } = Parabola::through(a, b, c)?;
    // k x² + (m - k (x2 + x3)) x + (y3 - m x3 + k x2 x3) = target
    let qb = m - k * (x2 + x3);
    let qc = y3 - m * x3 + k * x2 * x3 - target;
    let disc = qb * qb - 4.0 * k * qc;
    if disc < 0.0 {
        return None;
    }
    let root = (-qb + disc.sqrt()) / (2.0 * k);
    (root.is_finite() && root >= 1.0).then(|| root.floor() as usize)
}

/// The rows at which `peak = c × rows^α` through the two largest successes reaches `target`.
pub(super) fn power_law_rows(successes: &[(usize, u64)], target: f64) -> Option<usize> {
    let [.., (r1, p1), (r2, p2)] = successes else {
        return None;
    };
    let (x1, y1, x2, y2) = (*r1 as f64, *p1 as f64, *r2 as f64, *p2 as f64);
    if y1 <= 0.0 || y2 <= y1 || x2 <= x1 {
        return None;
    }
    let alpha = (y2 / y1).ln() / (x2 / x1).ln();
    let rows = x2 * (target / y2).powf(1.0 / alpha);
    (rows.is_finite() && rows >= 1.0).then(|| {
        if rows >= usize::MAX as f64 {
            usize::MAX
        } else {
            rows.floor() as usize
        }
    })
}

/// The parabola through three `(rows, peak)` points at `rows`, when it is convex (as
/// [`quadratic_rows`] uses it).
pub(super) fn quadratic_peak(
    a: (usize, u64),
    b: (usize, u64),
    c: (usize, u64),
    rows: usize,
) -> Option<f64> {
    Some(Parabola::through(a, b, c)?.at(rows as f64))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_parabola_through_three_points_predicts_and_solves() {
        // peak = 100 + 2 rows²
        let (a, b, c) = ((1, 102), (2, 108), (3, 118));
        assert_eq!(quadratic_peak(a, b, c, 5), Some(150.0));
        assert_eq!(quadratic_rows(a, b, c, 300.0), Some(10));
        assert_eq!(quadratic_rows(a, b, c, 301.0), Some(10));
        // on a line: not convex, no parabola
        let (a, b, c) = ((1, 10), (2, 20), (3, 30));
        assert_eq!(quadratic_peak(a, b, c, 5), None);
        assert_eq!(quadratic_rows(a, b, c, 100.0), None);
        // concave
        assert_eq!(quadratic_rows((1, 10), (2, 20), (3, 25), 100.0), None);
    }
}
