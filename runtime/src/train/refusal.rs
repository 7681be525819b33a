//! The refusal rules of a training step: every row is trained, and the step counts as training.

use std::fmt;
use std::panic::Location;

use crate::retry::advanced::{KeepsRows, Pressure, RetryContext, StepMode, MAX_ATTEMPTS};
use crate::retry::{BatchPlan, RetryEngine, RetryPolicy, RetryReport};

/// The first plan with fewer rows than `batch` that `policy` proposes under repeated pressure
/// of any kind ([`Pressure`]: out-of-memory, a budget's overrun, a request larger than the
/// whole card, allocator thrashing) starting from the whole batch, as the engine would follow
/// it. Policies depend only on their context, so this finds a row-dropping policy (e.g.
/// `inference_policy()`, `Shrink`, or one that drops rows under one pressure only) before a
/// real out-of-memory does. `None` when every plan it proposes keeps the batch.
///
/// ```
/// use oomguard_runtime::retry::{inference_policy, training_policy};
/// use oomguard_runtime::train::drops_rows;
/// assert!(drops_rows(&training_policy(), 100).is_none());
/// assert!(drops_rows(&inference_policy(), 100).unwrap().batch() < 100);
/// ```
pub fn drops_rows(policy: &dyn RetryPolicy, batch: usize) -> Option<BatchPlan> {
    let whole = BatchPlan::whole(batch).ok()?;
    // Every pressure the engine asks under: a policy may drop rows under one of them only.
    for pressure in [
        Pressure::Oom,
        Pressure::Budget,
        Pressure::TooLarge,
        Pressure::Thrash,
    ] {
        let mut plan = whole;
        for attempt in 1..=MAX_ATTEMPTS {
            let ctx = RetryContext::new(plan, batch, attempt, pressure);
            let Some(next) = policy.next_plan(&ctx) else {
                break;
            };
            if next.batch() < batch {
                return Some(next);
            }
            if !next.fits_within(&plan) {
                break; // the engine would give up here too
            }
            plan = next;
        }
    }
    None
}

/// The `hint` the framework crates' `train_step`s give [`keep_rows`]: what to use instead of a
/// policy that drops rows.
pub const KEEP_ROWS_HINT: &str = "train_step needs a policy that keeps every row: \
                                  `oomguard::retry::training_policy()` or an `Accumulate` chain";

/// The engine a training step of `batch` rows runs on: `engine` (its remembered plans,
/// consensus and regrow, shared) with its policy wrapped in [`KeepsRows`] (a plan with fewer
/// rows, proposed later by a policy that changes its mind, is refused when proposed: the step
/// gives up, and the log says why with `hint`) and its mode always [`StepMode::Train`] (a
/// training step is remembered apart from evaluations, and batch caps never apply).
///
/// Refused before anything runs ([`DropsRows`]): an engine whose policy would drop rows after
/// an out-of-memory ([`drops_rows`]). `hint` says what to use instead, in the framework's words.
///
/// ```
/// use oomguard_runtime::retry::{inference_policy, RetryEngine};
/// use oomguard_runtime::train::keep_rows;
/// assert!(keep_rows(&RetryEngine::new(), 100, "use training_policy()").is_ok());
/// let engine = RetryEngine::new().with_policy(inference_policy());
/// let refused = keep_rows(&engine, 100, "use training_policy()").unwrap_err();
/// assert_eq!(refused.batch, 100);
/// assert!(refused.to_string().contains("never drops rows"));
/// ```
#[track_caller]
pub fn keep_rows(
    engine: &RetryEngine,
    batch: usize,
    hint: &'static str,
) -> Result<RetryEngine, DropsRows> {
    let policy = engine.policy();
    if let Some(proposed) = drops_rows(&*policy, batch) {
        return Err(DropsRows::new(
            format!("{policy:?}"),
            proposed,
            batch,
            hint,
            Location::caller(),
        ));
    }
    Ok(engine
        .clone()
        .with_policy(KeepsRows::new(policy).hint(hint))
        .with_mode_hook(|| StepMode::Train))
}

/// A training step refused before anything ran: the engine's retry policy proposes fewer rows
/// than the batch after an out-of-memory, so the step would train on part of the batch.
#[derive(Clone, Debug)]
pub struct DropsRows {
    /// The policy, as `Debug` prints it.
    pub policy: String,
    /// The plan it proposes after out-of-memory errors, with fewer rows than the batch.
    pub proposed: BatchPlan,
    /// The batch's rows.
    pub batch: usize,
    /// What to use instead.
    pub hint: &'static str,
    /// The report of the refused step: no attempt, its `failure` this refusal.
    pub report: Box<RetryReport>,
}

impl DropsRows {
    fn new(
        policy: String,
        proposed: BatchPlan,
        batch: usize,
        hint: &'static str,
        site: &Location<'_>,
    ) -> Self {
        let whole = BatchPlan::whole(batch).unwrap_or(proposed);
        let mut refused = Self {
            policy,
            proposed,
            batch,
            hint,
            report: Box::new(RetryReport {
                hint: Some(hint.to_string()),
                ..RetryReport::starting(
                    format!("{}:{}:{}", site.file(), site.line(), site.column()),
                    StepMode::Train,
                    batch,
                    whole,
                )
            }),
        };
        refused.report.failure = Some(refused.to_string());
        refused
    }
}

impl fmt::Display for DropsRows {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "the engine's retry policy {} proposes {} after an out-of-memory, fewer rows than \
             the batch of {}: a training step never drops rows (it would train on part of the \
             batch). {}",
            self.policy, self.proposed, self.batch, self.hint
        )
    }
}

impl std::error::Error for DropsRows {}
