//! burn's side of oomguard's training-step contract ([`TrainFramework`]): the user slices each
//! chunk's rows ([`chunk_rows`](crate::chunk_rows)), [`GradAccumulator`] backpropagates and sums
//! (burn's `GradientsAccumulator`), the optimizer returns the updated model, and every phase
//! runs under [`catch_oom`] (cubecl reports an out-of-memory as a panic as often as an error).

use std::marker::PhantomData;

use burn::module::AutodiffModule;
use burn::optim::{GradientsParams, Optimizer};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::Tensor;
use oomguard::retry::Chunk;
use oomguard::train::{Gradients, TrainFramework, TrainUpdate};

use crate::train::GradAccumulator;
use crate::{catch_oom, compat, Error};

/// A burn step over `model`: the user's chunk loss (given the model, the chunk and the batch
/// `Bt` a finder made; `()` for [`train_step`](crate::train_step), whose closure holds its
/// tensors) and, for `train_step`, the optimizer and its learning rate (the finder's has none:
/// `O = ()`).
pub(crate) struct BurnStep<'m, B, M, L, O, Bt> {
    pub(crate) model: &'m M,
    pub(crate) chunk_loss: L,
    pub(crate) optimizer: O,
    pub(crate) lr: f64,
    pub(crate) batch: Types<B, Bt>,
}

/// The backend and the batch's type, which only the bounds name.
pub(crate) type Types<B, Bt> = PhantomData<(B, fn(&Bt))>;

impl<B, M, L, O, Bt> TrainFramework for BurnStep<'_, B, M, L, O, Bt>
where
    B: AutodiffBackend,
    M: AutodiffModule<B>,
    L: FnMut(&M, &Chunk, &Bt) -> Result<Tensor<B, 1>, Error>,
{
    type Error = Error;
    type Batch = Bt;
    type Loss = Tensor<B, 1>;
    type Accumulator = GradAccumulator<B, M>;
    type Grads = (GradientsParams, Option<B::Device>);

    /// burn's batch is sliced by the user's closure ([`chunk_rows`](crate::chunk_rows) checks
    /// each tensor's rows against the chunk's batch), so it does not say its rows here.
    fn batch_rows(&self, _batch: &Bt) -> Result<Option<usize>, String> {
        Ok(None)
    }

    fn chunk_loss(&mut self, batch: &Bt, chunk: &Chunk) -> Result<Tensor<B, 1>, Error> {
        (self.chunk_loss)(self.model, chunk, batch)
    }

    fn accumulator(&mut self) -> Result<GradAccumulator<B, M>, Error> {
        let t = compat::trainable::<B, M>(self.model);
        if t.trainable == 0 {
            return Err(Error::NothingToTrain { params: t.floats });
        }
        Ok(GradAccumulator::new())
    }

    fn backward(
        &self,
        acc: &mut GradAccumulator<B, M>,
        loss: Tensor<B, 1>,
        chunk: &Chunk,
    ) -> Result<(), Error> {
        acc.backward(self.model, loss, chunk)
    }

    fn gradients(&self, acc: GradAccumulator<B, M>) -> Result<Gradients<Self::Grads>, Error> {
        let (loss, rows, device) = (acc.loss(), acc.rows(), acc.device.clone());
        Ok(Gradients {
            grads: (acc.into_grads(self.model)?, device),
            loss,
            rows,
        })
    }

    fn batch_error(message: String) -> Error {
        Error::Rows(message)
    }

    fn catch<T>(f: impl FnOnce() -> Result<T, Error>) -> Result<T, Error> {
        catch_oom(f)
    }
}

impl<B, M, L, O, Bt> TrainUpdate for BurnStep<'_, B, M, L, &mut O, Bt>
where
    B: AutodiffBackend,
    M: AutodiffModule<B>,
    L: FnMut(&M, &Chunk, &Bt) -> Result<Tensor<B, 1>, Error>,
    O: Optimizer<M, B>,
{
    type Updated = M;

    /// The updated model (burn's optimizer returns a new one), after the device finished the
    /// update (so that its out-of-memory is this step's).
    fn update(&mut self, (grads, device): Self::Grads) -> Result<M, Error> {
        let updated = compat::optimizer_step(self.optimizer, self.lr, self.model.clone(), grads);
        if let Some(d) = &device {
            compat::sync::<B>(d)?;
        }
        Ok(updated)
    }
}
