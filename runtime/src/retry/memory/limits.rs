//! [`Limits`]: the caps learned from out-of-memory retries, and the plans they give.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::retry_report::BatchPlan;

/// Caps learned from out-of-memory retries; `None`: no cap.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Limits {
    /// The largest micro-batch (rows) known to work.
    pub micro_batch: Option<usize>,
    /// The largest batch (rows) known to work, when the batch itself had to shrink.
    pub batch: Option<usize>,
}

impl Limits {
    /// No cap.
    pub const NONE: Limits = Limits {
        micro_batch: None,
        batch: None,
    };

    /// The plan these limits give for a request of `batch` rows (`batch >= 1`).
    pub fn plan_for(&self, batch: usize) -> Option<BatchPlan> {
        let b = self.batch.map_or(batch, |cap| cap.min(batch)).max(1);
        let micro = self.micro_batch.map_or(b, |m| m.min(b)).max(1);
        BatchPlan::with_micro_batch(b.min(batch), micro).ok()
    }

    /// These limits tightened so that `plan` (which worked for a request of `requested` rows)
    /// is what they give.
    pub fn learned(self, plan: &BatchPlan, requested: usize) -> Limits {
        let mut out = self;
        if plan.micro_batch() < plan.batch() || plan.batch() < requested {
            out.micro_batch = Some(
                self.micro_batch
                    .map_or(plan.micro_batch(), |m| m.min(plan.micro_batch())),
            );
        }
        if plan.batch() < requested {
            out.batch = Some(self.batch.map_or(plan.batch(), |b| b.min(plan.batch())));
        }
        out
    }

    /// One size up for a request of `requested` rows: the batch cap doubled if it binds, else the
    /// micro-batch cap doubled; `None` when no cap binds.
    pub fn one_up(&self, requested: usize) -> Option<Limits> {
        let grow = |cap: usize| {
            let up = cap.saturating_mul(2);
            (up < requested).then_some(up)
        };
        if let Some(b) = self.batch.filter(|&b| b < requested) {
            return Some(Limits {
                batch: grow(b),
                ..*self
            });
        }
        let effective = self.batch.map_or(requested, |b| b.min(requested));
        if let Some(m) = self.micro_batch.filter(|&m| m < effective) {
            return Some(Limits {
                micro_batch: grow(m),
                ..*self
            });
        }
        None
    }
}

impl fmt::Display for Limits {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let show = |o: Option<usize>| o.map_or("none".to_string(), |v| v.to_string());
        write!(
            f,
            "micro-batch cap {}, batch cap {}",
            show(self.micro_batch),
            show(self.batch)
        )
    }
}
