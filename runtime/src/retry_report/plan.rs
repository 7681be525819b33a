//! Batch plans: a logical batch of `batch` rows split into `chunks` micro-batches.

use std::fmt;
use std::ops::Range;

use serde::{Deserialize, Serialize};

/// How one step processes its batch: rows `0..batch` in `chunks` micro-batches whose sizes differ
/// by at most one (100 rows in 3 → 34, 33, 33).
///
/// Each micro-batch carries the weight `len / batch`, so the sum of weighted per-micro-batch mean
/// losses (and their gradients) equals the mean loss of the whole batch.
///
/// ```
/// use oomguard_runtime::retry::BatchPlan;
/// let plan = BatchPlan::new(100, 3).unwrap();
/// let sizes: Vec<usize> = plan.chunks().map(|c| c.len()).collect();
/// assert_eq!(sizes, [34, 33, 33]);
/// let total: f64 = plan.chunks().map(|c| c.weight()).sum();
/// assert!((total - 1.0).abs() < 1e-12);
/// assert_eq!(plan.micro_batch(), 34);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "PlanFields")]
pub struct BatchPlan {
    batch: usize,
    chunks: usize,
}

/// A plan as serialized, checked by [`BatchPlan::new`] when read (a file that says
/// `{"batch":0,"chunks":0}` is an error, not a plan that divides by zero).
#[derive(Deserialize)]
struct PlanFields {
    batch: usize,
    chunks: usize,
}

impl TryFrom<PlanFields> for BatchPlan {
    type Error = PlanError;
    fn try_from(f: PlanFields) -> Result<Self, PlanError> {
        BatchPlan::new(f.batch, f.chunks)
    }
}

/// A plan that cannot exist (an empty batch, more chunks than rows).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("invalid batch plan: {0}")]
pub struct PlanError(pub String);

impl BatchPlan {
    /// `batch` rows in `chunks` micro-batches. Needs `1 <= chunks <= batch`.
    pub fn new(batch: usize, chunks: usize) -> Result<Self, PlanError> {
        if batch == 0 {
            return Err(PlanError("the batch has no rows".into()));
        }
        if chunks == 0 || chunks > batch {
            return Err(PlanError(format!(
                "{chunks} micro-batches for {batch} rows (need 1..={batch})"
            )));
        }
        Ok(Self { batch, chunks })
    }

    /// The whole batch in one micro-batch.
    pub fn whole(batch: usize) -> Result<Self, PlanError> {
        Self::new(batch, 1)
    }

    /// `batch` rows in micro-batches of at most `micro_batch` rows (as few as that allows).
    pub fn with_micro_batch(batch: usize, micro_batch: usize) -> Result<Self, PlanError> {
        if micro_batch == 0 {
            return Err(PlanError("a micro-batch of 0 rows".into()));
        }
        Self::new(batch, batch.div_ceil(micro_batch.min(batch.max(1))))
    }

    /// Rows processed by the step.
    pub fn batch(&self) -> usize {
        self.batch
    }

    /// Number of micro-batches.
    pub fn num_chunks(&self) -> usize {
        self.chunks
    }

    /// Rows of the largest micro-batch (`ceil(batch / chunks)`): what sizes the step's memory.
    pub fn micro_batch(&self) -> usize {
        self.batch.div_ceil(self.chunks)
    }

    /// The micro-batch with index `i`, if `i < num_chunks()`.
    pub fn chunk(&self, i: usize) -> Option<Chunk> {
        if i >= self.chunks {
            return None;
        }
        let (q, r) = (self.batch / self.chunks, self.batch % self.chunks);
        // The first `r` chunks hold q + 1 rows, the rest q.
        let start = i * q + i.min(r);
        let len = q + usize::from(i < r);
        Some(Chunk {
            index: i,
            count: self.chunks,
            rows: start..start + len,
            batch: self.batch,
        })
    }

    /// The micro-batches in order; together they cover `0..batch` exactly once.
    pub fn chunks(&self) -> impl ExactSizeIterator<Item = Chunk> + '_ {
        (0..self.chunks).map(move |i| self.chunk(i).expect("index below num_chunks"))
    }

    /// Whether this plan needs no more memory than `other` does: micro-batches no larger, and
    /// no more rows.
    pub fn fits_within(&self, other: &BatchPlan) -> bool {
        self.micro_batch() <= other.micro_batch() && self.batch <= other.batch
    }
}

impl fmt::Display for BatchPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.chunks == 1 {
            write!(f, "batch {} in one pass", self.batch)
        } else {
            write!(
                f,
                "batch {} in {} micro-batches of ≤{}",
                self.batch,
                self.chunks,
                self.micro_batch()
            )
        }
    }
}

/// One micro-batch of a [`BatchPlan`]: a range of rows and its weight in the batch.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Chunk {
    index: usize,
    count: usize,
    rows: Range<usize>,
    batch: usize,
}

impl Chunk {
    /// Position among the plan's micro-batches.
    pub fn index(&self) -> usize {
        self.index
    }
    /// Number of micro-batches in the plan.
    pub fn count(&self) -> usize {
        self.count
    }
    /// Whether this is the last micro-batch (where accumulated gradients are complete).
    pub fn is_last(&self) -> bool {
        self.index + 1 == self.count
    }
    /// The rows of the batch this micro-batch covers.
    pub fn rows(&self) -> Range<usize> {
        self.rows.clone()
    }
    /// First row.
    pub fn start(&self) -> usize {
        self.rows.start
    }
    /// One past the last row.
    pub fn end(&self) -> usize {
        self.rows.end
    }
    /// Number of rows.
    pub fn len(&self) -> usize {
        self.rows.len()
    }
    /// Whether it holds no row (never, for chunks of a valid plan).
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }
    /// Rows of the whole batch the plan splits (the step's batch).
    pub fn batch(&self) -> usize {
        self.batch
    }
    /// `len / batch`: multiply the micro-batch's mean loss (or its gradients) by this and sum over
    /// micro-batches to get the full batch's mean.
    pub fn weight(&self) -> f64 {
        self.rows.len() as f64 / self.batch as f64
    }
    /// [`Chunk::weight`] as `f32`.
    pub fn weight_f32(&self) -> f32 {
        self.weight() as f32
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn uneven_split() {
        let p = BatchPlan::new(100, 3).unwrap();
        let c: Vec<_> = p.chunks().map(|c| c.rows()).collect();
        assert_eq!(c, [0..34, 34..67, 67..100]);
        assert!(p.chunk(2).unwrap().is_last());
        assert!(p.chunks().all(|c| c.batch() == 100));
        assert!(p.chunk(3).is_none());
        assert_eq!(p.to_string(), "batch 100 in 3 micro-batches of ≤34");
    }

    /// Read back, a plan is checked as `new` checks it: `{"batch":0,"chunks":0}` was a plan
    /// whose `micro_batch` divided by zero (found by a hostile pass of the API).
    #[test]
    fn a_serialized_plan_is_checked_when_read() {
        let p = BatchPlan::new(100, 3).unwrap();
        let back: BatchPlan = serde_json::from_str(&serde_json::to_string(&p).unwrap()).unwrap();
        assert_eq!(back, p);
        for bad in [r#"{"batch":0,"chunks":0}"#, r#"{"batch":5,"chunks":9}"#] {
            let e = serde_json::from_str::<BatchPlan>(bad).unwrap_err();
            assert!(e.to_string().contains("invalid batch plan"), "{bad}: {e}");
        }
    }

    #[test]
    fn bad_plans_are_errors() {
        assert!(BatchPlan::new(0, 1).is_err());
        assert!(BatchPlan::new(5, 0).is_err());
        assert!(BatchPlan::new(5, 6)
            .unwrap_err()
            .to_string()
            .contains("6 micro-batches"));
        assert!(BatchPlan::with_micro_batch(5, 0).is_err());
        assert_eq!(BatchPlan::with_micro_batch(5, 9).unwrap().num_chunks(), 1);
        assert_eq!(
            BatchPlan::with_micro_batch(100, 34).unwrap().num_chunks(),
            3
        );
    }

    proptest! {
        #[test]
        fn chunks_partition_the_batch(batch in 1usize..5000, chunks in 1usize..200) {
            let chunks = chunks.min(batch);
            let p = BatchPlan::new(batch, chunks).unwrap();
            let mut next = 0;
            let (mut lo, mut hi) = (usize::MAX, 0);
            let mut w = 0.0;
            for c in p.chunks() {
                prop_assert_eq!(c.start(), next);
                next = c.end();
                lo = lo.min(c.len());
                hi = hi.max(c.len());
                w += c.weight();
            }
            prop_assert_eq!(next, batch);
            prop_assert!(hi - lo <= 1);
            prop_assert_eq!(hi, p.micro_batch());
            prop_assert!((w - 1.0).abs() < 1e-9);
        }
    }
}
