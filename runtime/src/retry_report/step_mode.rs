//! Whether a step trains or evaluates: part of where a plan is remembered, and of a report.

use serde::{Deserialize, Serialize};

/// Whether a step trains (builds gradients) or evaluates. Train and eval steps at the same call
/// site need different memory, so they are remembered separately.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StepMode {
    /// Gradients are recorded (the default).
    #[default]
    Train,
    /// No gradients (evaluation, inference).
    Eval,
}
