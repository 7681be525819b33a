//! The batch's mean loss from its chunks' mean losses, and the check that a chunk's loss is one
//! value.

use std::ops::Range;

use crate::retry::Chunk;

/// `Err` (the refusal's text) when a chunk's loss is not finite: a NaN or infinite loss makes
/// every gradient, and after the optimizer's step every parameter, NaN. The step is refused
/// before its update, as a loss of the wrong shape is.
///
/// ```
/// use oomguard_runtime::retry::BatchPlan;
/// let plan = BatchPlan::new(8, 2).unwrap();
/// let c = plan.chunk(1).unwrap();
/// assert!(oomguard_runtime::train::finite_loss(&c, 0.5).is_ok());
/// let e = oomguard_runtime::train::finite_loss(&c, f64::NAN).unwrap_err();
/// assert!(e.contains("rows 4..8") && e.contains("NaN"), "{e}");
/// ```
pub fn finite_loss(chunk: &Chunk, value: f64) -> Result<(), String> {
    if value.is_finite() {
        return Ok(());
    }
    Err(format!(
        "the loss of rows {:?} is {value}: not trained on (its gradients would make every \
         parameter NaN); the optimizer did not step. Check the inputs and the learning rate, \
         or skip the batch",
        chunk.rows()
    ))
}

/// Checks that a chunk's loss is one value (`elements == 1`), as the weighting needs: each
/// chunk's gradients are weighted by its share of the batch, which turns per-chunk *means* into
/// the batch's mean. Per-row losses (or a sum) would make the update depend on how an
/// out-of-memory split the batch. `example` names the framework's way to take the mean (e.g.
/// ``"`.mean_all()`"``), quoted in the error.
///
/// ```
/// use oomguard_runtime::train::one_value;
/// assert!(one_value(1, &[], 0..4, "`.mean()`").is_ok());
/// let e = one_value(8, &[8], 0..8, "`.mean()`").unwrap_err();
/// assert!(e.contains("shape [8]") && e.contains("per-row mean"), "{e}");
/// ```
pub fn one_value(
    elements: usize,
    shape: &[usize],
    chunk: Range<usize>,
    example: &str,
) -> Result<(), String> {
    if elements == 1 {
        return Ok(());
    }
    Err(format!(
        "the loss of chunk {chunk:?} has {elements} elements (shape {shape:?}): give the \
         chunk's per-row mean loss, one value (e.g. {example}); per-row losses or a sum would \
         make the update depend on how the batch was split"
    ))
}

/// The weighted sum of the chunks' mean losses of one attempt (the batch's mean loss, in `f64`)
/// and the row ranges they cover, checked to come from one batch and, at the end, to cover it:
/// every row exactly once.
///
/// ```
/// use oomguard_runtime::retry::BatchPlan;
/// use oomguard_runtime::train::LossSum;
/// let plan = BatchPlan::with_micro_batch(10, 4)?; // 4 + 3 + 3 rows
/// let mut sum = LossSum::new();
/// for (c, mean) in plan.chunks().zip([1.0, 2.0, 3.0]) {
///     sum.admit(&c)?;
///     sum.add_mean(&c, mean);
/// }
/// sum.covers_batch()?;
/// assert!((sum.loss() - (4.0 * 1.0 + 3.0 * 2.0 + 3.0 * 3.0) / 10.0).abs() < 1e-12);
/// assert_eq!(sum.rows(), 10);
/// // a chunk that ran already is refused before its backward
/// assert!(sum.admit(&plan.chunk(0).unwrap()).is_err());
/// // a chunk that failed after its gradients were added: the accumulator refuses from then on
/// assert!(sum.check_usable().is_ok());
/// sum.fail_after_gradients("a NaN loss");
/// assert!(sum.check_usable().unwrap_err().contains("(a NaN loss)"));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LossSum {
    loss: f64,
    rows: usize,
    batch: Option<usize>,
    /// The row ranges added, in the order added (a chunk carries its range, so the check is by
    /// rows, not by their count: the same chunk twice is not two chunks).
    ranges: Vec<Range<usize>>,
    /// The batch of a chunk added (without [`LossSum::admit`]) to a sum of another batch.
    other_batch: Option<usize>,
    /// Why a chunk failed after its gradients were added ([`LossSum::fail_after_gradients`]).
    failed: Option<String>,
}

impl LossSum {
    /// An empty sum.
    pub fn new() -> Self {
        Self::default()
    }

    /// Checks that `chunk` belongs to the batch of the chunks admitted or added before (the
    /// first one sets it) and that none of its rows was added already (the same chunk twice, or
    /// chunks of two plans that overlap). Call it before the chunk's backward, so that a foreign
    /// or repeated chunk adds nothing.
    pub fn admit(&mut self, chunk: &Chunk) -> Result<(), String> {
        match self.batch {
            Some(b) if b != chunk.batch() => Err(format!(
                "a chunk of a batch of {} rows added to an accumulator of a batch of {b} rows",
                chunk.batch()
            )),
            _ => {
                let rows = chunk.rows();
                if let Some(r) = self
                    .ranges
                    .iter()
                    .find(|r| r.start < rows.end && rows.start < r.end)
                {
                    return Err(format!(
                        "the chunk of rows {rows:?} overlaps rows {r:?}, added already: each \
                         row of the batch must be backpropagated exactly once (the same chunk \
                         twice, or chunks of two plans?)"
                    ));
                }
                self.batch = Some(chunk.batch());
                Ok(())
            }
        }
    }

    /// Adds the chunk's mean loss, weighted by its share of the batch (`chunk.weight()`), and
    /// its rows.
    pub fn add_mean(&mut self, chunk: &Chunk, mean_loss: f64) {
        self.add_weighted(chunk, mean_loss * chunk.weight());
    }

    /// Adds a loss already weighted by the chunk's share (read from the weighted loss the
    /// backward ran on), and the chunk's rows (its range: [`LossSum::covers_batch`] checks
    /// them).
    pub fn add_weighted(&mut self, chunk: &Chunk, weighted_loss: f64) {
        self.loss += weighted_loss;
        self.rows += chunk.len();
        // a chunk of another batch is refused by `admit`; one added without it, by
        // `covers_batch`
        if *self.batch.get_or_insert(chunk.batch()) != chunk.batch() {
            self.other_batch = Some(chunk.batch());
        }
        self.ranges.push(chunk.rows());
    }

    /// The batch's mean loss so far.
    pub fn loss(&self) -> f64 {
        self.loss
    }

    /// Rows added so far (a row added twice counts twice).
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// The batch of the admitted chunks (`None` before the first).
    pub fn batch(&self) -> Option<usize> {
        self.batch
    }

    /// Marks the accumulator this sum belongs to as unusable: a chunk failed after its
    /// gradients were added to the framework's sum (reading or synchronising its loss, an
    /// out-of-memory, a NaN), so that sum holds a chunk this one does not count. Every later
    /// [`LossSum::check_usable`] refuses, saying `why`.
    pub fn fail_after_gradients(&mut self, why: impl std::fmt::Display) {
        self.failed = Some(why.to_string());
    }

    /// The refusal once [`LossSum::fail_after_gradients`] was called (the framework crates'
    /// accumulators check it before each chunk and before their gradients are taken).
    pub fn check_usable(&self) -> Result<(), String> {
        match &self.failed {
            Some(why) => Err(format!(
                "an earlier chunk failed after its gradients were added to this accumulator \
                 ({why}): its sum is not the batch's; start a new `GradAccumulator` (and run \
                 the batch's chunks again)"
            )),
            None => Ok(()),
        }
    }

    /// Checks that the chunks added cover their whole batch, every row exactly once (every chunk
    /// of the plan ran, none twice). The error names the rows added more than once and the rows
    /// that never ran.
    pub fn covers_batch(&self) -> Result<(), String> {
        let Some(batch) = self.batch else {
            return Ok(());
        };
        if let Some(other) = self.other_batch {
            return Err(format!(
                "a chunk of a batch of {other} rows was added to the losses of a batch of \
                 {batch} rows"
            ));
        }
        let mut ranges = self.ranges.clone();
        ranges.sort_by_key(|r| (r.start, r.end));
        let (mut twice, mut never): (Vec<Range<usize>>, Vec<Range<usize>>) =
            (Vec::new(), Vec::new());
        // rows 0..covered are added at least once
        let mut covered = 0;
        for r in &ranges {
            if r.start > covered {
                never.push(covered..r.start);
            }
            if r.start < covered {
                let again = r.start..r.end.min(covered);
                // sorted by start: a range added three times meets the last one
                match twice.last_mut() {
                    Some(last) if again.start <= last.end => {
                        last.end = last.end.max(again.end);
                    }
                    _ => twice.push(again),
                }
            }
            covered = covered.max(r.end);
        }
        if covered < batch {
            never.push(covered..batch);
        }
        if twice.is_empty() && never.is_empty() {
            return Ok(());
        }
        let list = |v: &[Range<usize>]| {
            v.iter()
                .map(|r| format!("{r:?}"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let mut problems = Vec::new();
        if !twice.is_empty() {
            problems.push(format!("rows {} were added more than once", list(&twice)));
        }
        if !never.is_empty() {
            problems.push(format!("rows {} never ran", list(&never)));
        }
        let off: usize = twice.iter().chain(&never).map(|r| r.len()).sum();
        Err(format!(
            "only {} of the batch's {batch} rows were backpropagated exactly once: {}; every \
             chunk of the plan must be, once",
            batch.saturating_sub(off),
            problems.join("; ")
        ))
    }
}
