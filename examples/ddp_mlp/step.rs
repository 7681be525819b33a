//! One data-parallel training step of the MLP as a retry-engine [`Step`]: the micro-batch loop
//! only accumulates this rank's share of the gradient (no collective inside it); the commit, which
//! runs once on every rank after the engine's flag exchange said every rank succeeded, sums the
//! gradients over the ranks and applies the update.

use oomguard::retry::{BatchPlan, Chunk, GradientSync, Step};
use oomguard::{Device, Error};

use crate::model::Mlp;
use crate::ops::Ops;

/// A rank's step over its `plan.batch()` rows of a global batch of `global` rows.
pub struct DdpStep<'a> {
    pub dev: &'a Device,
    pub ops: &'a dyn Ops,
    pub mlp: &'a mut Mlp,
    pub sync: &'a dyn GradientSync,
    /// Rows in the global batch (all ranks together).
    pub global: usize,
    /// Index in the data set of this rank's first row of this step.
    pub first_row: usize,
    pub seed: u64,
    pub lr: f32,
    /// Sum of this rank's losses in the current attempt.
    pub loss: f64,
}

impl Step for DdpStep<'_> {
    type Error = Error;
    /// The sum of this rank's losses, or the error of the gradient all-reduce or the update.
    type Output = Result<f64, Error>;

    fn begin(&mut self, _plan: &BatchPlan) -> Result<(), Error> {
        self.loss = 0.0;
        self.mlp.zero_grads(self.ops)
    }

    fn micro_batch(&mut self, chunk: &Chunk) -> Result<(), Error> {
        let rows = chunk.len();
        let (d_in, classes) = (self.mlp.dims[0], self.mlp.classes());
        let mut x = self.dev.alloc::<f32>(rows * d_in)?;
        let mut y = self.dev.alloc::<u32>(rows)?;
        self.ops.gen_data(
            &mut x,
            &mut y,
            self.seed,
            self.first_row + chunk.start(),
            d_in,
            classes,
        )?;
        let (logits, saved) = self.mlp.forward(self.dev, self.ops, x, rows)?;
        let mut dlogits = self.dev.alloc::<f32>(rows * classes)?;
        // Scaled by 1/global, not 1/local: the sum over ranks is the global batch's gradient.
        let (l, _) = self.ops.softmax_xent(
            &logits,
            &y,
            Some(&mut dlogits),
            classes,
            1.0 / self.global as f32,
        )?;
        drop((logits, y));
        let saved = saved
            .ok_or_else(|| Error::InvalidArgument("grad mode is off in a training step".into()))?;
        self.mlp
            .backward(self.dev, self.ops, saved, dlogits, rows)?;
        self.loss += l;
        Ok(())
    }

    fn commit(&mut self) -> Result<f64, Error> {
        let Mlp { grad_w, grad_b, .. } = &mut *self.mlp;
        let mut grads: Vec<_> = grad_w.iter_mut().chain(grad_b.iter_mut()).collect();
        self.sync.sum_gradients(&mut grads)?;
        self.mlp.sgd(self.ops, self.lr)?;
        Ok(self.loss)
    }
}
