//! A training loop's record of its steps, and the check that it does the real job: the loss
//! falls.

use std::fmt;

use super::TrainedStep;

/// The losses and retries of a loop's steps ([`TrainedStep`]s, in order), for the check a
/// training run owes before its figures mean anything: the loss fell. Its `Display` is one line,
/// `loss: FIRST -> LAST, N retries in S steps`.
///
/// ```
/// use oomguard_runtime::train::LossCurve;
/// let mut curve = LossCurve::new();
/// for loss in [1.0, 0.7, 0.4] {
///     curve.push_loss(loss, 0);
/// }
/// assert_eq!(curve.to_string(), "loss: 1.0000 -> 0.4000, 0 retries in 3 steps");
/// assert!(curve.check_fell_by(2.0).is_ok());
/// assert!(curve.check_fell_by(4.0).is_err());
/// ```
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LossCurve {
    losses: Vec<f64>,
    retries: usize,
}

impl LossCurve {
    /// An empty curve.
    pub fn new() -> Self {
        Self::default()
    }

    /// Records one step: its loss and its retries.
    pub fn push(&mut self, step: &TrainedStep) {
        self.push_loss(step.loss, step.report.retries());
    }

    /// Records one step from its loss and its retries (a loop that does not use `train_step`).
    pub fn push_loss(&mut self, loss: f64, retries: usize) {
        self.losses.push(loss);
        self.retries += retries;
    }

    /// The steps' losses, in order.
    pub fn losses(&self) -> &[f64] {
        &self.losses
    }

    /// The retries of all the steps.
    pub fn retries(&self) -> usize {
        self.retries
    }

    /// `Ok` when the last loss is finite and below the first divided by `factor` (2.0: it fell
    /// by half); otherwise a [`LossDidNotFall`] that says what it did. Fewer than two steps, a
    /// first loss that is not finite, a first loss that is not above 0 (a fall by a factor is
    /// measured from a positive loss: a negative log-likelihood going from −1 to −0.6 is below
    /// −1 / 2 but rose) and a `factor` that is not a finite number above 1 are refused the same
    /// way (nothing shows the loss fell).
    pub fn check_fell_by(&self, factor: f64) -> Result<(), LossDidNotFall> {
        let (first, last) = (self.first(), self.last());
        let fell = self.losses.len() >= 2
            && factor.is_finite()
            && factor > 1.0
            && first.is_finite()
            && first > 0.0
            && last.is_finite()
            && last < first / factor;
        if fell {
            return Ok(());
        }
        Err(LossDidNotFall {
            first,
            last,
            steps: self.losses.len(),
            factor,
        })
    }

    fn first(&self) -> f64 {
        self.losses.first().copied().unwrap_or(f64::NAN)
    }

    fn last(&self) -> f64 {
        self.losses.last().copied().unwrap_or(f64::NAN)
    }
}

impl fmt::Display for LossCurve {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "loss: {:.4} -> {:.4}, {} retries in {} steps",
            self.first(),
            self.last(),
            self.retries,
            self.losses.len()
        )
    }
}

/// A loop's loss did not fall as [`LossCurve::check_fell_by`] asked.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LossDidNotFall {
    /// The first step's loss (NaN without steps).
    pub first: f64,
    /// The last step's loss (NaN without steps).
    pub last: f64,
    /// The steps recorded.
    pub steps: usize,
    /// The factor asked for.
    pub factor: f64,
}

impl fmt::Display for LossDidNotFall {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.steps < 2 {
            return write!(
                f,
                "the loss cannot be seen to fall: {} step(s) recorded",
                self.steps
            );
        }
        if !(self.factor.is_finite() && self.factor > 1.0) {
            return write!(
                f,
                "a loss that falls by a factor of {}: not a fall",
                self.factor
            );
        }
        if self.first.is_finite() && self.first <= 0.0 {
            return write!(
                f,
                "a fall by a factor is measured from a positive loss: {} -> {} in {} steps",
                self.first, self.last, self.steps
            );
        }
        write!(
            f,
            "the loss did not fall to 1/{} of its first value in {} steps: {} -> {}",
            self.factor, self.steps, self.first, self.last
        )
    }
}

impl std::error::Error for LossDidNotFall {}

#[cfg(test)]
mod tests {
    use super::*;

    fn curve(losses: &[f64]) -> LossCurve {
        let mut c = LossCurve::new();
        for &l in losses {
            c.push_loss(l, 1);
        }
        c
    }

    #[test]
    fn a_loss_that_halves_passes_and_one_that_does_not_says_so() {
        let c = curve(&[2.0, 1.5, 0.9]);
        assert_eq!(c.check_fell_by(2.0), Ok(()));
        assert_eq!(c.retries(), 3);
        let e = c.check_fell_by(3.0).unwrap_err();
        assert_eq!(
            e.to_string(),
            "the loss did not fall to 1/3 of its first value in 3 steps: 2 -> 0.9"
        );
    }

    #[test]
    fn non_finite_losses_short_curves_and_bad_factors_are_refused() {
        for losses in [
            &[1.0, f64::NAN][..],
            &[f64::INFINITY, 0.1],
            &[1.0, f64::INFINITY],
        ] {
            assert!(curve(losses).check_fell_by(2.0).is_err(), "{losses:?}");
        }
        // a negative loss that rose, and losses from 0, show no fall by a factor
        for losses in [&[-1.0, -0.6][..], &[-1.0, -3.0], &[0.0, -1.0]] {
            let e = curve(losses).check_fell_by(2.0).unwrap_err();
            assert!(e.to_string().contains("positive loss"), "{losses:?}: {e}");
        }
        let e = curve(&[1.0]).check_fell_by(2.0).unwrap_err();
        assert!(e.to_string().contains("1 step(s)"), "{e}");
        assert!(curve(&[]).check_fell_by(2.0).is_err());
        for factor in [1.0, 0.5, f64::NAN, f64::INFINITY] {
            let e = curve(&[4.0, 0.1]).check_fell_by(factor).unwrap_err();
            assert!(e.to_string().contains("not a fall"), "{factor}: {e}");
        }
    }

    #[test]
    fn the_line_names_first_last_retries_and_steps() {
        assert_eq!(
            curve(&[1.23456, 0.5]).to_string(),
            "loss: 1.2346 -> 0.5000, 2 retries in 2 steps"
        );
        assert_eq!(
            LossCurve::new().to_string(),
            "loss: NaN -> NaN, 0 retries in 0 steps"
        );
    }
}
