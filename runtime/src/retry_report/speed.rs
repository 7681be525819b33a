//! What the engine decided, for speed, about a plan whose steps churned.

use std::fmt;
use std::time::Duration;

use super::plan::BatchPlan;

/// What the engine did, for speed, about a plan whose steps churn without allocator retries
/// (pages moved, synchronisations inside the allocator; a step with allocator retries moves
/// down at once, see [`RetryReport::thrash_moved_to`]). Decided by time per row of successful
/// attempts (the median over the measured steps), the larger plan winning ties.
///
/// [`RetryReport::thrash_moved_to`]: crate::retry::RetryReport::thrash_moved_to
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum SpeedDecision {
    /// `thrashing` churned in every step of the thrash window: from the next step `smaller`
    /// runs, one step to settle, then `steps` measured steps, and the faster per row is kept.
    Trying {
        /// The plan whose steps churned.
        thrashing: BatchPlan,
        /// The next smaller plan (the policy's, for [`Pressure::Thrash`](crate::retry::Pressure)).
        smaller: BatchPlan,
        /// `thrashing`'s time per row over the window.
        thrashing_per_row: Duration,
        /// Steps of `smaller` that are measured.
        steps: u32,
    },
    /// The trial ended: `kept` runs from the next step (and is remembered). When it is
    /// `thrashing`, the engine moved back to it: the smaller plan was not faster per row.
    Chose {
        /// The plan whose steps churned.
        thrashing: BatchPlan,
        /// The smaller plan tried.
        smaller: BatchPlan,
        /// `thrashing`'s time per row.
        thrashing_per_row: Duration,
        /// `smaller`'s time per row.
        smaller_per_row: Duration,
        /// The faster of the two.
        kept: BatchPlan,
    },
    /// `thrashing` churned through another window, but `smaller` was measured slower per row:
    /// the plan stays; the smaller one is tried again after `windows_left` more windows.
    Stayed {
        /// The plan whose steps churned (kept).
        thrashing: BatchPlan,
        /// The smaller plan that lost.
        smaller: BatchPlan,
        /// `thrashing`'s time per row when they were compared.
        thrashing_per_row: Duration,
        /// `smaller`'s time per row when they were compared.
        smaller_per_row: Duration,
        /// Thrash windows to go before the next trial.
        windows_left: u32,
    },
}

impl SpeedDecision {
    /// The plan the engine moves to from the next step because of this decision (`None`: it
    /// stays on the plan of this step).
    pub fn moves_to(&self) -> Option<BatchPlan> {
        match *self {
            SpeedDecision::Trying { smaller, .. } => Some(smaller),
            SpeedDecision::Chose {
                thrashing, kept, ..
            } if kept == thrashing => Some(thrashing),
            _ => None,
        }
    }
}

impl fmt::Display for SpeedDecision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            SpeedDecision::Trying {
                thrashing,
                smaller,
                thrashing_per_row,
                steps,
            } => write!(
                f,
                "{thrashing} churned in every step of the thrash window ({thrashing_per_row:.3?} \
                 per row): trying {smaller} for {steps} measured steps; the faster per row is kept"
            ),
            SpeedDecision::Chose {
                thrashing,
                smaller,
                thrashing_per_row,
                smaller_per_row,
                kept,
            } => {
                write!(
                    f,
                    "{smaller} took {smaller_per_row:.3?} per row, {thrashing} \
                     {thrashing_per_row:.3?}: "
                )?;
                if kept == thrashing {
                    write!(
                        f,
                        "moved back to {thrashing} (the smaller plan is not faster per row)"
                    )
                } else {
                    write!(f, "kept {smaller} (faster per row)")
                }
            }
            SpeedDecision::Stayed {
                thrashing,
                smaller,
                thrashing_per_row,
                smaller_per_row,
                windows_left,
            } => write!(
                f,
                "{thrashing} churned again; kept, as {smaller} took {smaller_per_row:.3?} per row \
                 against {thrashing_per_row:.3?} (tried again after {windows_left} more thrash \
                 windows)"
            ),
        }
    }
}
