//! Exact gradient accumulation over the micro-batches of one attempt.

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor};
use oomguard::retry::Chunk;
use oomguard::train::{missing_gradients, name_list, one_value, LossSum};

use crate::params::{Param, Params};

/// Sums the gradients of the micro-batches of one attempt into the gradient of the batch's mean
/// loss.
///
/// **Each chunk's loss must be its per-row mean** (a scalar: `.mean_all()`, candle-nn's
/// `cross_entropy`, `mse`): the chunk's gradients are weighted by its share of the batch
/// (`len / batch`, in `f64`/`f32` whatever the loss's dtype), which turns the per-chunk means
/// into the batch's mean. A *sum* over rows would make the update depend on how an OOM split
/// the batch; a loss with more than one element is refused. Statistics over the whole batch
/// (BatchNorm in training mode, in-batch negatives of a contrastive loss, centring by the batch
/// mean) cannot be split exactly at all: each chunk sees only its own rows.
///
/// Every trained variable must receive a gradient in the step ([`GradAccumulator::into_grads`]
/// fails, naming them, when one did not), and every float variable the loss depends on must be
/// trained or frozen ([`GradAccumulator::backward`] fails otherwise): see [`Params`]. A
/// variable that gets no gradient usually means a forward-only op cut the graph, as candle-nn
/// 0.11's `LayerNorm` module, `ops::softmax_last_dim` and `ops::rms_norm` do (see the crate
/// docs).
///
/// The sum equals one full-batch backward up to floating-point rounding. Only the variables'
/// gradients are kept (a backward pass also returns those of every intermediate tensor, which
/// are dropped at once); half-precision gradients are summed in their own dtype, each scaled
/// in `f32` first.
#[derive(Debug)]
pub struct GradAccumulator {
    params: Params,
    grads: Vec<Option<Tensor>>,
    sum: LossSum,
}

impl GradAccumulator {
    /// An empty accumulator for `params` (a slice of `Var`s, a `&VarMap` or a [`Params`]).
    pub fn new(params: impl Into<Params>) -> Self {
        let params = params.into();
        Self {
            grads: vec![None; params.trained.len()],
            params,
            sum: LossSum::new(),
        }
    }

    /// Backpropagates `chunk_loss`, the chunk's per-row *mean* loss (a scalar), and adds the
    /// trained variables' gradients weighted by `chunk.weight()`.
    ///
    /// Errors: a loss with more than one element; a NaN or infinite loss
    /// ([`oomguard::train::finite_loss`]); chunks of different batches; a float variable in the
    /// loss's graph that is neither trained nor frozen. An error after the gradients were
    /// added (reading the loss, a NaN) leaves the accumulator refusing every later call: start
    /// a new one.
    pub fn backward(&mut self, chunk_loss: &Tensor, chunk: &Chunk) -> candle_core::Result<()> {
        self.sum.check_usable().map_err(crate::oom::refusal)?;
        one_value(
            chunk_loss.elem_count(),
            chunk_loss.dims(),
            chunk.rows(),
            "`.mean_all()`",
        )
        .map_err(crate::oom::refusal)?;
        if !chunk_loss.dtype().is_float() {
            // (an integer loss carries no gradient: it was "no gradient reached ...", which
            // pointed at candle-nn's forward-only ops)
            return Err(crate::oom::refusal(format!(
                "the loss of rows {:?} is {:?}, not a float: backpropagation needs a float \
                 loss (compute it in f32 or wider)",
                chunk.rows(),
                chunk_loss.dtype()
            )));
        }
        self.sum.admit(chunk).map_err(crate::oom::refusal)?;
        self.check_graph(chunk_loss)?;

        // The unweighted loss is backpropagated (its seed, 1, is exact in every dtype) and the
        // gradients are scaled afterwards: a half-precision loss multiplied by `len / batch`
        // would round the weight to 8 or 11 bits.
        let mut g = chunk_loss.backward()?;
        let w = chunk.weight();
        for (param, acc) in self.params.trained.iter().zip(&mut self.grads) {
            let Some(new) = g.remove(param.var.as_tensor()) else {
                continue;
            };
            let new = scaled(&new, w)?;
            *acc = Some(match acc.take() {
                Some(old) => (old + new)?.detach(),
                None => new.detach(),
            });
        }
        drop(g);
        let read = (|| -> candle_core::Result<f64> {
            let value = chunk_loss
                .to_dtype(DType::F64)?
                .flatten_all()?
                .to_vec1::<f64>()?[0];
            oomguard::train::finite_loss(chunk, value).map_err(crate::oom::refusal)?;
            Ok(value)
        })();
        match read {
            Ok(value) => {
                self.sum.add_mean(chunk, value);
                Ok(())
            }
            Err(e) => {
                self.sum.fail_after_gradients(&e);
                Err(e)
            }
        }
    }

    /// A float variable the loss depends on that is in neither list would silently stay as it
    /// is: the optimizer never sees its gradient.
    fn check_graph(&self, loss: &Tensor) -> candle_core::Result<()> {
        let known = self.params.known_ids();
        let unknown: Vec<&Tensor> = loss
            .sorted_nodes()
            .into_iter()
            .filter(|t| t.is_variable() && t.dtype().is_float() && !known.contains(&t.id()))
            .collect();
        if unknown.is_empty() {
            return Ok(());
        }
        let list: Vec<String> = unknown
            .iter()
            .map(|t| format!("{:?} {:?}", t.dims(), t.dtype()))
            .collect();
        Err(crate::oom::refusal(format!(
            "{} variable(s) in the loss's graph are not among the step's parameters ({}): the \
             optimizer would never see their gradients and they would stay frozen without anyone \
             deciding so. Pass every variable the optimizer updates (`Params::from_varmap`), or \
             freeze them explicitly (`Params::freeze`)",
            unknown.len(),
            name_list(&list)
        )))
    }

    /// The batch's mean loss so far (the weighted sum of the chunks' mean losses, in `f64`).
    pub fn loss(&self) -> f64 {
        self.sum.loss()
    }

    /// Rows backpropagated so far.
    pub fn rows(&self) -> usize {
        self.sum.rows()
    }

    /// The summed gradients, for `Optimizer::step`, each in its variable's dtype.
    ///
    /// Errors: a trained variable received no gradient in any chunk (they are named: index
    /// among the trained variables, name, shape, dtype); the chunks did not cover the batch.
    pub fn into_grads(self) -> candle_core::Result<GradStore> {
        self.sum.check_usable().map_err(crate::oom::refusal)?;
        self.sum.covers_batch().map_err(crate::oom::refusal)?;
        let missing: Vec<(usize, &Param)> = self
            .params
            .trained
            .iter()
            .zip(&self.grads)
            .enumerate()
            .filter(|(_, (_, g))| g.is_none())
            .map(|(i, (p, _))| (i, p))
            .collect();
        if !missing.is_empty() {
            let list: Vec<String> = missing.iter().map(|(i, p)| p.describe(*i)).collect();
            return Err(crate::oom::refusal(format!(
                "{}. The loss does not depend on them through differentiable ops: candle-nn \
                 0.11's `LayerNorm` module (contiguous input with a bias), `RmsNorm`, \
                 `ops::layer_norm`, `ops::rms_norm` and `ops::softmax_last_dim` are forward-only \
                 and cut the graph (use `ops::layer_norm_slow` with the module's weight and \
                 bias, `ops::rms_norm_slow`, `ops::softmax(.., D::Minus1)`), as does \
                 `detach()`. If they are frozen on purpose, say so with `Params::freeze`",
                missing_gradients(&list, self.params.trained.len())
            )));
        }
        let mut store = GradStore::default();
        for (p, g) in self.params.trained.iter().zip(self.grads) {
            let g = g.expect("checked above: every trained variable has a gradient");
            store.insert(p.var.as_tensor(), g.to_dtype(p.var.dtype())?);
        }
        Ok(store)
    }
}

/// `g × w`, with `w` applied in `f32` at least (a half-precision gradient is scaled in `f32`
/// and rounded back once); `w == 1` (a whole-batch chunk) costs nothing.
fn scaled(g: &Tensor, w: f64) -> candle_core::Result<Tensor> {
    if w == 1.0 {
        return Ok(g.clone());
    }
    match g.dtype() {
        DType::F16 | DType::BF16 => (g.to_dtype(DType::F32)? * w)?.to_dtype(g.dtype()),
        _ => g * w,
    }
}
