//! tch's side of the harness's phases (`oomguard_harness::Bench`): a fresh model and optimizer
//! per session, seeded token batches, the plain tch step, `oomguard_tch::train_step` as the
//! guarded step (each micro-batch's rows held on the simulated card on the CPU), and the
//! parameters as f64 copies to compare.

use std::sync::Arc;

use oomguard::retry::{FinderError, FinderOptions, FinderReport, RetryEngine};
use oomguard::train::TrainedStep;
use oomguard::MemorySource;
use oomguard_harness::{Bench, Optim};
use oomguard_tch::{train_step, Error};
use tch::nn::{self, OptimizerConfig};
use tch::{Device, Kind, TchError, Tensor};

use crate::charge::Charge;
use crate::model::{synthetic_tokens, Config, Gpt};
use crate::plain_step::{plain_step, sync};

/// What every phase works with.
pub struct TchBench {
    pub dev: Device,
    pub cfg: Config,
    pub charge: Charge,
    /// Where the steps' memory comes from, as oomguard sees it: libtorch's CUDA caching
    /// allocator (`LibtorchCudaSource`, registered), oomguard's allocator under libtorch, or
    /// the simulated card on the CPU.
    pub source: Arc<dyn MemorySource>,
    pub seed: u64,
    pub lr: f64,
    pub sgd_lr: f64,
}

/// A model and its optimizer.
pub struct Session {
    pub vs: nn::VarStore,
    pub model: Gpt,
    pub opt: nn::Optimizer,
}

impl TchBench {
    /// A fresh model with the run's seeded initialisation (the same weights at every call).
    pub fn model(&self) -> Result<(nn::VarStore, Gpt), TchError> {
        tch::manual_seed(self.seed as i64);
        let vs = nn::VarStore::new(self.dev);
        let model = Gpt::new(&vs, self.cfg)?;
        Ok((vs, model))
    }

    /// AdamW (tch's defaults: betas 0.9/0.999, weight decay 0.01) at `--lr`.
    pub fn adamw(&self, vs: &nn::VarStore) -> Result<nn::Optimizer, TchError> {
        nn::AdamW::default().build(vs, self.lr)
    }

    /// Seeded tokens `(rows, seq + 1)`; `salt` picks another batch.
    pub fn tokens(&self, rows: i64, salt: u64) -> Result<Tensor, TchError> {
        let seed = self.seed ^ salt.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        synthetic_tokens(seed, rows, &self.cfg, self.dev)
    }
}

/// The parameters of `vs`, sorted by name, as f64 copies.
fn params(vs: &nn::VarStore) -> Result<Vec<(String, Tensor)>, TchError> {
    let mut v: Vec<_> = vs.variables().into_iter().collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v.into_iter()
        .map(|(n, t)| Ok((n, t.f_detach()?.f_to_kind(Kind::Double)?)))
        .collect()
}

impl Bench for TchBench {
    type Error = Error;
    type Session = Session;
    type Batch = Tensor;
    type Params = Vec<(String, Tensor)>;

    fn source(&self) -> &Arc<dyn MemorySource> {
        &self.source
    }

    fn row_len(&self) -> i64 {
        self.cfg.seq
    }

    fn session(&self, optim: Optim) -> Result<Session, Error> {
        let (vs, model) = self.model()?;
        let opt = match optim {
            Optim::Sgd => nn::Sgd::default().build(&vs, self.sgd_lr)?,
            Optim::AdamW => self.adamw(&vs)?,
        };
        Ok(Session { vs, model, opt })
    }

    fn batch(&self, rows: i64, salt: u64) -> Result<Tensor, Error> {
        Ok(self.tokens(rows, salt)?)
    }

    fn plain_step(&self, s: &mut Session, b: &Tensor) -> Result<f64, Error> {
        plain_step(&s.model, &mut s.opt, b, self.dev, &self.charge)
    }

    fn guarded_step(
        &self,
        engine: &RetryEngine,
        s: &mut Session,
        b: &Tensor,
    ) -> Result<TrainedStep, String> {
        let model = &s.model;
        let done = train_step(
            engine,
            &self.source,
            &[b],
            &s.vs,
            &mut s.opt,
            |chunk, rows| {
                let _held = self.charge.rows(chunk.len() as i64)?;
                Ok(model.loss(&rows[0])?)
            },
        )
        .map_err(|e| e.to_string())?;
        sync(self.dev).map_err(|e| e.to_string())?;
        Ok(done)
    }

    fn params(&self, s: &Session) -> Result<Self::Params, String> {
        params(&s.vs).map_err(|e| e.to_string())
    }

    /// `‖a − b‖ / ‖a‖` and the largest `|a − b|` over every parameter (f64 sums).
    fn compare(&self, a: &Self::Params, b: &Self::Params) -> Result<(f64, f64), String> {
        if a.len() != b.len() || a.iter().zip(b).any(|(x, y)| x.0 != y.0) {
            return Err("the two models have different parameters".into());
        }
        let (mut d2, mut n2, mut max) = (0f64, 0f64, 0f64);
        for ((_, x), (_, y)) in a.iter().zip(b) {
            let d = x.f_sub(y).map_err(|e| e.to_string())?;
            let sq = |t: &Tensor| -> Result<f64, TchError> {
                t.f_square()?.f_sum(Kind::Double)?.f_double_value(&[])
            };
            d2 += sq(&d).map_err(|e| e.to_string())?;
            n2 += sq(x).map_err(|e| e.to_string())?;
            let m = d
                .f_abs()
                .and_then(|t| t.f_max())
                .and_then(|t| t.f_double_value(&[]))
                .map_err(|e| e.to_string())?;
            max = max.max(m);
        }
        Ok(((d2 / n2.max(f64::MIN_POSITIVE)).sqrt(), max))
    }

    /// Elements that are a NaN or an infinity, over every variable.
    fn non_finite_params(&self, s: &Session) -> Result<i64, String> {
        let mut non_finite = 0i64;
        for (_, v) in s.vs.variables() {
            non_finite += v
                .f_isfinite()
                .and_then(|t| t.f_logical_not())
                .and_then(|t| t.f_sum(Kind::Int64))
                .and_then(|t| t.f_int64_value(&[]))
                .map_err(|e| e.to_string())?;
        }
        Ok(non_finite)
    }

    /// `oomguard_tch::find_max_batch`: libtorch's out-of-memory panics caught, and kept quiet.
    fn find_max_batch(
        &self,
        opts: FinderOptions,
        step: &mut dyn FnMut(usize) -> Result<f64, Error>,
    ) -> Result<FinderReport, FinderError<Error>> {
        oomguard_tch::find_max_batch(&*self.source, opts, step)
    }
}
