//! tch's side of oomguard's training-step contract ([`TrainFramework`]): the batch's tensors, a
//! chunk's rows by `narrow`, libtorch accumulating each weighted backward into the parameters'
//! `.grad()`, the optimizer's step, and libtorch's out-of-memory panics caught.

use std::collections::HashSet;

use oomguard::retry::Chunk;
use oomguard::train::{batch_rows, one_value, Gradients, LossSum, TrainFramework, TrainUpdate};
use tch::{nn, Kind, Tensor};

use crate::catch::catch_torch;
use crate::Error;

/// A tch step: the trained variables (name, tensor; sorted by name), the optimizer (both
/// phases need it: an attempt resets its gradients, the update steps it) and the user's chunk
/// loss.
pub(crate) struct TchStep<'o, L> {
    pub(crate) trained: Vec<(String, Tensor)>,
    /// The store's variables, frozen ones included (for [`Error::NothingToTrain`]).
    pub(crate) variables: usize,
    pub(crate) optimizer: &'o mut nn::Optimizer,
    pub(crate) chunk_loss: L,
    /// The batch's tensors that take a gradient (leaves, `requires_grad`: an input gradient),
    /// reset with the variables' at every attempt and after a failure.
    batch_leaves: Vec<Tensor>,
}

impl<'o, L> TchStep<'o, L> {
    /// A step over `vs`'s variables that require a gradient.
    pub(crate) fn new(vs: &nn::VarStore, optimizer: &'o mut nn::Optimizer, chunk_loss: L) -> Self {
        let all = vs.variables();
        let variables = all.len();
        let mut trained: Vec<(String, Tensor)> =
            all.into_iter().filter(|(_, t)| t.requires_grad()).collect();
        trained.sort_by(|a, b| a.0.cmp(&b.0));
        Self {
            trained,
            variables,
            optimizer,
            chunk_loss,
            batch_leaves: Vec::new(),
        }
    }

    /// The bytes of the trained variables' gradients (what a split step holds while its later
    /// chunks run).
    pub(crate) fn trained_bytes(&self) -> u64 {
        self.trained
            .iter()
            .map(|(_, t)| (t.numel() * t.kind().elt_size_in_bytes()) as u64)
            .sum()
    }

    /// Zeroes the gradients of the batch's tensors that take one (as `zero_grad` does the
    /// variables').
    fn zero_batch_gradients(&mut self) {
        for t in &mut self.batch_leaves {
            t.zero_grad();
        }
    }

    /// [`Error::NoGradient`] for `params` (names, sorted), against the variables that require
    /// a gradient.
    fn no_gradient(&self, params: Vec<String>) -> Error {
        let trained = self
            .trained
            .iter()
            .filter(|(_, t)| t.requires_grad())
            .count();
        Error::NoGradient { params, trained }
    }

    /// [`Error::NotOptimized`]: trained variables the optimizer does not hold.
    fn not_optimized(&self) -> Result<(), Error> {
        let theirs: HashSet<usize> = self
            .optimizer
            .trainable_variables()
            .iter()
            .map(|t| t.data_ptr() as usize)
            .collect();
        let params: Vec<String> = self
            .trained
            .iter()
            .filter(|(_, t)| t.numel() > 0 && !theirs.contains(&(t.data_ptr() as usize)))
            .map(|(name, _)| name.clone())
            .collect();
        if params.is_empty() {
            Ok(())
        } else {
            Err(Error::NotOptimized { params })
        }
    }
}

impl<L> TrainFramework for TchStep<'_, L>
where
    L: FnMut(&Chunk, &[Tensor]) -> Result<Tensor, Error>,
{
    type Error = Error;
    type Batch = [Tensor];
    type Loss = Tensor;
    type Accumulator = LossSum;
    type Grads = ();

    fn batch_rows(&self, batch: &[Tensor]) -> Result<Option<usize>, String> {
        if let Some(i) = batch.iter().position(|t| t.requires_grad() && !t.is_leaf()) {
            // each chunk of a split step backpropagates through its rows of the graph again:
            // libtorch refuses the second ("backward through the graph a second time"), and only
            // once an out-of-memory splits the batch
            return Err(format!(
                "batch tensor {i} carries autograd history (it requires a gradient and was \
                 computed from other tensors, e.g. the model's embedding applied outside the \
                 loss): compute it inside the loss closure, or pass `.detach()`"
            ));
        }
        let shapes: Vec<Vec<usize>> = batch.iter().map(dims).collect();
        let shapes: Vec<&[usize]> = shapes.iter().map(Vec::as_slice).collect();
        batch_rows(&shapes).map(Some)
    }

    fn chunk_loss(&mut self, batch: &[Tensor], chunk: &Chunk) -> Result<Tensor, Error> {
        if chunk.start() == 0 {
            // an attempt starts: the input gradients restart with the variables'
            self.batch_leaves = batch
                .iter()
                .filter(|t| t.requires_grad())
                .map(Tensor::shallow_clone)
                .collect();
            self.zero_batch_gradients();
        }
        let (start, len) = (chunk.start() as i64, chunk.len() as i64);
        let rows = batch
            .iter()
            .map(|t| t.f_narrow(0, start, len))
            .collect::<Result<Vec<_>, _>>()?;
        (self.chunk_loss)(chunk, &rows)
    }

    fn accumulator(&mut self) -> Result<LossSum, Error> {
        if self.trained.is_empty() {
            return Err(Error::NothingToTrain {
                variables: self.variables,
            });
        }
        self.not_optimized()?;
        // A failed attempt's partial gradients never reach the next one.
        self.optimizer.zero_grad();
        Ok(LossSum::new())
    }

    fn backward(&self, sum: &mut LossSum, loss: Tensor, c: &Chunk) -> Result<(), Error> {
        one_value(
            loss.numel(),
            &dims(&loss),
            c.rows(),
            "`loss.mean(Kind::Float)`",
        )
        .map_err(Error::Loss)?;
        sum.admit(c).map_err(Error::Loss)?;
        let weighted = match loss.kind() {
            Kind::Half | Kind::BFloat16 => loss.f_to_kind(Kind::Float)?,
            _ => loss.shallow_clone(),
        };
        let weighted = if c.weight() == 1.0 {
            weighted
        } else {
            weighted.f_mul_scalar(c.weight())?
        };
        if !weighted.requires_grad() {
            // libtorch would refuse the backward with its stack: say which variables it cuts off
            return Err(self.no_gradient(self.trained.iter().map(|(n, _)| n.clone()).collect()));
        }
        weighted.f_backward()?;
        // Reading the value waits for the device: this chunk's errors surface here.
        let value = loss.f_reshape([-1])?.f_double_value(&[0])?;
        oomguard::train::finite_loss(c, value).map_err(Error::Loss)?;
        sum.add_mean(c, value);
        Ok(())
    }

    fn gradients(&self, sum: LossSum) -> Result<Gradients<()>, Error> {
        sum.covers_batch().map_err(Error::Loss)?;
        let missing: Vec<String> = self
            .trained
            .iter()
            .filter(|(_, t)| t.requires_grad() && !t.grad().defined())
            .map(|(name, _)| name.clone())
            .collect();
        if !missing.is_empty() {
            return Err(self.no_gradient(missing));
        }
        Ok(Gradients {
            grads: (),
            loss: sum.loss(),
            rows: sum.rows(),
        })
    }

    fn batch_error(message: String) -> Error {
        Error::Batch(message)
    }

    fn catch<T>(f: impl FnOnce() -> Result<T, Error>) -> Result<T, Error> {
        catch_torch(f)
    }

    fn discard_gradients(&mut self) {
        // It frees tensors and allocates nothing: a panic here is a bug, and continues.
        self.optimizer.zero_grad();
        self.zero_batch_gradients();
    }
}

impl<L> TrainUpdate for TchStep<'_, L>
where
    L: FnMut(&Chunk, &[Tensor]) -> Result<Tensor, Error>,
{
    type Updated = ();

    fn update(&mut self, (): ()) -> Result<(), Error> {
        self.optimizer.step();
        Ok(())
    }
}

/// A tensor's shape, as `usize`s.
pub(crate) fn dims(t: &Tensor) -> Vec<usize> {
    t.size().iter().map(|&d| d as usize).collect()
}
