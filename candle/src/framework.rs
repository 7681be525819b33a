//! candle's side of oomguard's training-step contract ([`TrainFramework`]): the batch's tensors,
//! a chunk's rows by `narrow`, [`GradAccumulator`]'s weighted backward, candle-nn's optimizer.

use candle_core::backprop::GradStore;
use candle_core::Tensor;
use candle_nn::Optimizer;
use oomguard::retry::Chunk;
use oomguard::train::{batch_rows, Gradients, TrainFramework, TrainUpdate};

use crate::accumulator::GradAccumulator;
use crate::params::Params;

/// A candle step: the trained variables, the user's chunk loss and (for
/// [`train_step`](crate::train_step)) the optimizer; the finder's has none (`O = ()`).
pub(crate) struct CandleStep<L, O> {
    pub(crate) params: Params,
    pub(crate) chunk_loss: L,
    pub(crate) optimizer: O,
}

impl<L, O> TrainFramework for CandleStep<L, O>
where
    L: FnMut(&Chunk, &[Tensor]) -> candle_core::Result<Tensor>,
{
    type Error = candle_core::Error;
    type Batch = [Tensor];
    type Loss = Tensor;
    type Accumulator = GradAccumulator;
    type Grads = GradStore;

    fn batch_rows(&self, batch: &[Tensor]) -> Result<Option<usize>, String> {
        let shapes: Vec<&[usize]> = batch.iter().map(|t| t.dims()).collect();
        batch_rows(&shapes).map(Some)
    }

    fn chunk_loss(&mut self, batch: &[Tensor], chunk: &Chunk) -> candle_core::Result<Tensor> {
        let rows = batch
            .iter()
            .map(|t| crate::rows::chunk_rows(t, chunk))
            .collect::<candle_core::Result<Vec<_>>>()?;
        (self.chunk_loss)(chunk, &rows)
    }

    fn accumulator(&mut self) -> candle_core::Result<GradAccumulator> {
        if self.params.trained.is_empty() {
            return Err(crate::oom::refusal(format!(
                "no variable to train: the step's parameters are {} (the optimizer's step would \
                 change nothing). Pass every variable the optimizer updates",
                if self.params.frozen.is_empty() {
                    "empty"
                } else {
                    "all frozen"
                }
            )));
        }
        Ok(GradAccumulator::new(&self.params))
    }

    fn backward(
        &self,
        acc: &mut GradAccumulator,
        loss: Tensor,
        chunk: &Chunk,
    ) -> candle_core::Result<()> {
        acc.backward(&loss, chunk)
    }

    fn gradients(&self, acc: GradAccumulator) -> candle_core::Result<Gradients<GradStore>> {
        let (loss, rows) = (acc.loss(), acc.rows());
        Ok(Gradients {
            grads: acc.into_grads()?,
            loss,
            rows,
        })
    }

    fn batch_error(message: String) -> candle_core::Error {
        crate::oom::refusal(message)
    }
}

impl<L, O> TrainUpdate for CandleStep<L, &mut O>
where
    L: FnMut(&Chunk, &[Tensor]) -> candle_core::Result<Tensor>,
    O: Optimizer,
{
    type Updated = ();

    fn update(&mut self, grads: GradStore) -> candle_core::Result<()> {
        self.optimizer.step(&grads)
    }
}
