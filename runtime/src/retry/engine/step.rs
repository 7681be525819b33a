//! What the engine runs: a [`Step`] of the caller's, or a closure, as an attempt.

use std::fmt;

use crate::retry::classify::IsOom;
use crate::retry_report::{BatchPlan, Chunk};

/// A training (or evaluation) step processed micro-batch by micro-batch; see the
/// [contract](crate::retry#the-contract).
///
/// ```
/// # extern crate oomguard_runtime as oomguard; // as the facade re-exports it
/// use oomguard::retry::{BatchPlan, Chunk, RetryEngine, Step};
/// use oomguard::{ByteSize, Device, Error};
///
/// struct MeanStep<'a> { data: &'a [f32], dev: Device, acc: f32, param: f32 }
/// impl Step for MeanStep<'_> {
///     type Error = Error;
///     type Output = f32;
///     fn begin(&mut self, _plan: &BatchPlan) -> Result<(), Error> { self.acc = 0.0; Ok(()) }
///     fn micro_batch(&mut self, c: &Chunk) -> Result<(), Error> {
///         let rows = self.dev.from_slice(&self.data[c.rows()])?; // device memory, freed on drop
///         let host = rows.to_vec()?;
///         self.acc += c.weight_f32() * host.iter().sum::<f32>() / c.len() as f32;
///         Ok(())
///     }
///     fn commit(&mut self) -> f32 { self.param -= self.acc; self.param }
/// }
///
/// let dev = Device::sim(ByteSize::gib(1));
/// let data = [1.0f32, 2.0, 3.0, 6.0];
/// let mut step = MeanStep { data: &data, dev: dev.clone(), acc: 0.0, param: 10.0 };
/// let out = RetryEngine::new().run_step(&dev, data.len(), &mut step).unwrap();
/// assert_eq!(out.value, 7.0);
/// ```
pub trait Step {
    /// The step's error; out-of-memory ones are retried.
    type Error: IsOom + fmt::Display;
    /// What the commit returns.
    type Output;
    /// Starts an attempt with `plan`: reset accumulated gradients here.
    fn begin(&mut self, _plan: &BatchPlan) -> Result<(), Self::Error> {
        Ok(())
    }
    /// Processes one micro-batch; add `chunk.weight()` × its gradients to the accumulator.
    fn micro_batch(&mut self, chunk: &Chunk) -> Result<(), Self::Error>;
    /// The attempt failed (here or on another rank): free what it accumulated, if you like.
    fn abort(&mut self) {}
    /// Applies the update. Called exactly once, after every micro-batch of an attempt succeeded.
    fn commit(&mut self) -> Self::Output;
}

/// The engine's view of an attempt: run it, or clean up after one that does not count.
pub(super) trait Attempt<G, E> {
    fn attempt(&mut self, plan: &BatchPlan) -> Result<G, E>;
    fn discard(&mut self);
}

pub(super) struct ClosureAttempt<F>(pub(super) F);

impl<G, E, F: FnMut(&BatchPlan) -> Result<G, E>> Attempt<G, E> for ClosureAttempt<F> {
    fn attempt(&mut self, plan: &BatchPlan) -> Result<G, E> {
        (self.0)(plan)
    }
    fn discard(&mut self) {}
}

pub(super) struct StepAttempt<'a, S>(pub(super) &'a mut S);

impl<S: Step> Attempt<(), S::Error> for StepAttempt<'_, S> {
    fn attempt(&mut self, plan: &BatchPlan) -> Result<(), S::Error> {
        self.0.begin(plan)?;
        for c in plan.chunks() {
            self.0.micro_batch(&c)?;
        }
        Ok(())
    }
    fn discard(&mut self) {
        self.0.abort();
    }
}
