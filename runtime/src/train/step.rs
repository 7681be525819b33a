//! The skeleton of a training step over any [`TrainFramework`], and of the finder that measures
//! it.

use std::cell::RefCell;
use std::fmt;

use super::framework::{Gradients, TrainFramework, TrainUpdate};
use super::{keep_rows, HeldBatch, TrainStepError, TrainedStep, KEEP_ROWS_HINT};
use crate::retry::{
    BatchPlan, FinderError, FinderOptions, FinderReport, RetryEngine, RetryError, RetryReport,
};
use crate::source::MemorySource;

/// One attempt over `plan`: every chunk's loss, backpropagated weighted into one accumulator,
/// then the gradients checked and taken (not under [`TrainFramework::catch`]: the callers
/// wrap it). Gradients whose [`Gradients::rows`] are not the plan's rows are
/// [`TrainFramework::batch_error`] (the framework counted some chunk's rows wrong, or not at
/// all: the step's report would say a batch its gradients do not cover).
pub fn attempt<F: TrainFramework>(
    parts: &mut F,
    batch: &F::Batch,
    plan: &BatchPlan,
) -> Result<Gradients<F::Grads>, F::Error> {
    let mut acc = parts.accumulator()?;
    for c in plan.chunks() {
        let loss = parts.chunk_loss(batch, &c)?;
        parts.backward(&mut acc, loss, &c)?;
    }
    let g = parts.gradients(acc)?;
    if g.rows != plan.batch() {
        return Err(F::batch_error(format!(
            "the framework's gradients say {} rows were backpropagated for a plan of {} rows \
             ({plan}): its accumulator must count every chunk's rows",
            g.rows,
            plan.batch()
        )));
    }
    Ok(g)
}

/// What a successful [`train_step`] gives: what the step did, and the update's value.
#[derive(Debug)]
pub struct Stepped<U> {
    /// The loss, rows and retry report.
    pub step: TrainedStep,
    /// What [`TrainUpdate::update`] returned.
    pub updated: U,
}

/// One training step of `parts` over `batch`, kept alive through out-of-memory.
///
/// The batch's rows come from [`TrainFramework::batch_rows`] (refused as
/// [`TrainStepError::InvalidBatch`] when the tensors disagree, or do not say); an engine whose
/// policy would drop rows is refused before anything runs ([`TrainStepError::PolicyDropsRows`],
/// [`keep_rows`]). Then ([`train_step_kept`]) [`RetryEngine::run`] reruns [`attempt`] (under
/// [`TrainFramework::catch`]) with smaller plans after each out-of-memory, and runs
/// [`TrainUpdate::update`] once (under `catch` too) on the gradients of the attempt that
/// succeeded: its error is [`TrainStepError::Update`], never retried. The plan is remembered
/// per caller (`#[track_caller]`) and source.
#[track_caller]
pub fn train_step<F, S>(
    engine: &RetryEngine,
    source: &S,
    parts: &mut F,
    batch: &F::Batch,
) -> Result<Stepped<F::Updated>, TrainStepError<F::Error>>
where
    F: TrainUpdate,
    S: MemorySource + Clone,
{
    let rows = match parts.batch_rows(batch) {
        Ok(Some(rows)) => rows,
        Ok(None) => {
            return Err(TrainStepError::InvalidBatch(
                "the batch does not say its rows".into(),
            ))
        }
        Err(e) => return Err(TrainStepError::InvalidBatch(e)),
    };
    // The same engine (remembered plans, consensus, regrow), its policy unable to drop rows.
    let engine = keep_rows(engine, rows, KEEP_ROWS_HINT)?;
    Ok(train_step_kept(&engine, source, parts, batch, rows)?)
}

/// Why [`train_step_kept`] failed: the two failures of a step that passed its refusals (the
/// variants of [`TrainStepError`] of the same names, which it converts into).
#[derive(Debug)]
pub enum StepFailure<E> {
    /// The attempts failed: not an out-of-memory, or out-of-memory at the smallest plan the
    /// policy allows.
    Retry(RetryError<E>),
    /// The update failed; not retried.
    Update {
        /// The update's error.
        error: E,
        /// How the attempts went.
        report: Box<RetryReport>,
    },
}

impl<E> From<StepFailure<E>> for TrainStepError<E> {
    fn from(f: StepFailure<E>) -> Self {
        match f {
            StepFailure::Retry(e) => TrainStepError::Retry(e),
            StepFailure::Update { error, report } => TrainStepError::Update { error, report },
        }
    }
}

/// [`train_step`] after its refusals: `engine` is what [`keep_rows`] returned for `rows` (a
/// framework whose refusal is its own error calls `keep_rows` itself, then this). Reruns
/// [`attempt`] until it fits, then [`TrainUpdate::update`] once; errors are
/// [`TrainStepError::Retry`] and [`TrainStepError::Update`] only.
#[track_caller]
pub fn train_step_kept<F, S>(
    engine: &RetryEngine,
    source: &S,
    parts: &mut F,
    batch: &F::Batch,
    rows: usize,
) -> Result<Stepped<F::Updated>, StepFailure<F::Error>>
where
    F: TrainUpdate,
    S: MemorySource + Clone,
{
    // Both phases need the parts: the attempt its loss, the commit its optimizer.
    let parts = RefCell::new(parts);
    let retried = engine
        .run(
            source,
            rows,
            |plan: &BatchPlan| {
                let _unwinding = DiscardOnUnwind(&parts);
                let tried = F::catch(|| attempt(&mut **parts.borrow_mut(), batch, plan));
                if tried.is_err() {
                    parts.borrow_mut().discard_gradients();
                }
                tried
            },
            |g: Gradients<F::Grads>| {
                let _unwinding = DiscardOnUnwind(&parts);
                let updated = F::catch(|| parts.borrow_mut().update(g.grads));
                (updated, g.loss, g.rows)
            },
        )
        .map_err(|e| {
            parts.borrow_mut().discard_gradients();
            StepFailure::Retry(e)
        })?;
    let report = retried.report;
    match retried.value {
        (Ok(updated), loss, rows) => Ok(Stepped {
            step: TrainedStep { loss, rows, report },
            updated,
        }),
        (Err(error), ..) => {
            parts.borrow_mut().discard_gradients();
            Err(StepFailure::Update {
                error,
                report: Box::new(report),
            })
        }
    }
}

/// Discards the gradients when a panic that [`TrainFramework::catch`] let through unwinds out
/// of an attempt or an update, as after any failure: a loop that catches the panic and steps
/// its optimizer would otherwise apply part of a batch.
struct DiscardOnUnwind<'a, 'p, F: TrainFramework>(&'a RefCell<&'p mut F>);

impl<F: TrainFramework> Drop for DiscardOnUnwind<'_, '_, F> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            // (the attempt's borrow was dropped before this, unwinding)
            if let Ok(mut parts) = self.0.try_borrow_mut() {
                // a framework that panics here too (the first panic left its device broken)
                // must not escape a destructor while unwinding: that aborts the process
                let discarded = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    parts.discard_gradients();
                }));
                if discarded.is_err() {
                    tracing::error!(
                        target: "oomguard::train",
                        "discarding the gradients panicked while an earlier panic unwound: they \
                         may be left filled"
                    );
                }
            }
        }
    }
}

/// The largest batch for which [`train_step`]'s own attempt over `parts` fits on `source`
/// ([`crate::retry::find_max_batch`]): a run of `rows` rows makes the batch with
/// `make_batch(rows)` (measured with [`HeldBatch`], held for the whole run), checks its rows
/// ([`TrainFramework::batch_rows`]: another number is [`TrainFramework::batch_error`], which
/// ends the search), and runs the attempt over the whole batch in one chunk, holding the
/// gradients until the run ends, all under [`TrainFramework::catch`], then
/// [`TrainFramework::discard_gradients`]. Nothing is updated.
/// `accumulation_bytes`: the report's [`FinderReport::accumulation_bytes`] (what a split step
/// holds of summed gradients while its later chunks run).
pub fn find_max_batch_train<F, S, Bt>(
    source: &S,
    opts: FinderOptions,
    parts: &mut F,
    mut make_batch: impl FnMut(usize) -> Result<Bt, F::Error>,
    accumulation_bytes: Option<u64>,
) -> Result<FinderReport, FinderError<F::Error>>
where
    F: TrainFramework,
    F::Error: fmt::Debug,
    S: MemorySource + ?Sized,
    Bt: std::borrow::Borrow<F::Batch>,
{
    let held = HeldBatch::new();
    let found = crate::retry::find_max_batch(source, opts, |rows| {
        let parts = RefCell::new(&mut *parts);
        let _unwinding = DiscardOnUnwind(&parts);
        let mut parts = parts.borrow_mut();
        let run = F::catch(|| {
            let batch = held.measure(source, rows, || make_batch(rows))?;
            let batch = batch.borrow();
            match parts.batch_rows(batch) {
                Ok(Some(n)) if n != rows => {
                    return Err(F::batch_error(format!(
                        "make_batch({rows}) gave a batch of {n} rows"
                    )))
                }
                Ok(_) => {}
                Err(e) => return Err(F::batch_error(format!("make_batch({rows}): {e}"))),
            }
            let plan = BatchPlan::whole(rows)
                .map_err(|e| F::batch_error(format!("a batch of {rows} rows: {e}")))?;
            Ok(attempt(&mut **parts, batch, &plan)?.loss)
        });
        // Nothing steps after a run: no gradient is left for a later update.
        parts.discard_gradients();
        run
    })?;
    let mut found = held.into_report(found);
    found.accumulation_bytes = accumulation_bytes;
    Ok(found)
}
