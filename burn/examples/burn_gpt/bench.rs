//! burn's side of the harness's phases (`oomguard_harness::Bench`): a fresh seeded model (its
//! lazy parameters made at once) with AdamW or SGD per session, seeded token batches, the plain
//! burn step under `catch_oom`, `oomguard_burn::train_step` as the guarded step (on ndarray each
//! micro-batch's rows charged to the simulated card), and the parameters as host copies.

use std::sync::Arc;

use burn::backend::Autodiff;
use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::adaptor::OptimizerAdaptor;
use burn::optim::{AdamW, AdamWConfig, GradientsParams, Optimizer, Sgd, SgdConfig};
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};
use oomguard::retry::{Chunk, FinderError, FinderOptions, FinderReport, RetryEngine, RetryReport};
use oomguard::{DeviceBuffer, MemorySource};
use oomguard_burn::{catch_oom, chunk_rows, train_step, Error, TrainedStep};
use oomguard_harness::{attempts_str, one_line, plan_str, Bench, Line, Optim};

use crate::model::{Gpt, GptConfig};

/// The autodiff backend over `B`.
pub type Ad<B> = Autodiff<B>;
/// The model the phases train.
pub type Model<B> = Gpt<Ad<B>>;
/// A batch: tokens `[rows, seq + 1]`.
pub type Tokens<B> = Tensor<Ad<B>, 2, Int>;

/// A session's optimizer.
pub enum Opt<B: Backend> {
    AdamW(OptimizerAdaptor<AdamW, Model<B>, Ad<B>>),
    Sgd(OptimizerAdaptor<Sgd<B>, Model<B>, Ad<B>>),
}

/// A model, its optimizer and the optimizer's learning rate.
pub struct Session<B: Backend> {
    pub model: Model<B>,
    pub opt: Opt<B>,
    pub lr: f64,
}

/// On the simulated card (ndarray): bytes charged per row of a step, held while it runs.
pub struct Charge {
    pub sim: Option<oomguard::Device>,
    pub per_row: usize,
}

impl Charge {
    /// Nothing simulated (CUDA).
    pub fn none() -> Self {
        Self {
            sim: None,
            per_row: 0,
        }
    }

    fn rows(&self, rows: usize) -> Result<Option<DeviceBuffer<u8>>, Error> {
        match &self.sim {
            Some(s) => Ok(Some(s.alloc::<u8>(rows.saturating_mul(self.per_row))?)),
            None => Ok(None),
        }
    }
}

/// What every phase works with.
pub struct BurnBench<B: Backend> {
    pub cfg: GptConfig,
    pub dev: B::Device,
    /// cubecl's pools on the driver pool (CUDA), or the simulated card (ndarray).
    pub source: Arc<dyn MemorySource>,
    pub charge: Charge,
    pub seed: u64,
    pub lr: f64,
    pub sgd_lr: f64,
}

/// Makes every lazy parameter (burn draws a parameter's weights at its first use).
struct Materialize;

impl<Bk: Backend> ModuleVisitor<Bk> for Materialize {
    fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<Bk, D>>) {
        let _ = p.val();
    }
}

/// Every float parameter's values, in visit order.
#[derive(Default)]
struct Collect {
    values: Vec<Vec<f32>>,
    error: Option<String>,
}

impl<Bk: Backend> ModuleVisitor<Bk> for Collect {
    fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<Bk, D>>) {
        match p.val().try_into_data() {
            Ok(d) => self.values.push(d.iter::<f32>().collect()),
            Err(e) => {
                self.error.get_or_insert(e.to_string());
            }
        }
    }
}

impl<B: Backend> BurnBench<B> {
    /// A fresh model: the backend seeded with `--seed` and every parameter made at once, so
    /// that every call gives the same weights.
    pub fn model(&self) -> Result<Model<B>, Error> {
        catch_oom(|| {
            Ad::<B>::seed(&self.dev, self.seed);
            let model = self.cfg.init::<Ad<B>>(&self.dev);
            model.visit(&mut Materialize);
            Ad::<B>::sync(&self.dev)?;
            Ok::<_, Error>(model)
        })
    }

    /// AdamW (burn's defaults) at `--lr`.
    pub fn adamw(&self) -> Opt<B> {
        Opt::AdamW(AdamWConfig::new().init())
    }

    /// Seeded synthetic tokens `[rows, seq + 1]` (xorshift64*; `salt` picks another batch).
    pub fn tokens(&self, rows: usize, salt: u64) -> Result<Tokens<B>, Error> {
        let len = self.cfg.seq + 1;
        let mut x = (self.seed ^ salt.wrapping_mul(0x9E37_79B9_7F4A_7C15)) | 1;
        let vocab = self.cfg.vocab as i64;
        let v: Vec<i64> = (0..rows * len)
            .map(|_| {
                x ^= x >> 12;
                x ^= x << 25;
                x ^= x >> 27;
                (x.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 33) as i64 % vocab
            })
            .collect();
        catch_oom(|| {
            Ok::<_, Error>(Tensor::from_data(
                TensorData::new(v, [rows, len]),
                &self.dev,
            ))
        })
    }

    /// A fresh AdamW session that has taken one plain step of one row (the optimizer's state
    /// exists, as in training).
    pub fn warm_session(&self) -> Result<Session<B>, String> {
        let mut s = self.session(Optim::AdamW).map_err(|e| e.to_string())?;
        let one = self.tokens(1, 999).map_err(|e| e.to_string())?;
        self.plain_step(&mut s, &one)
            .map_err(|e| format!("a warm-up step of one row failed: {e}"))?;
        Ok(s)
    }

    /// cubecl frees its unused pages, the device syncs, the cache is emptied; errors ignored
    /// (a sync after an out-of-memory may report it again).
    pub fn cleanup(&self) {
        let _ = catch_oom(|| {
            B::memory_cleanup(&self.dev);
            Ad::<B>::sync(&self.dev)
        });
        let _ = catch_oom(|| self.source.empty_cache());
    }
}

impl<B: Backend> Bench for BurnBench<B> {
    type Error = Error;
    type Session = Session<B>;
    type Batch = Tokens<B>;
    type Params = Vec<Vec<f32>>;

    fn source(&self) -> &Arc<dyn MemorySource> {
        &self.source
    }

    fn row_len(&self) -> i64 {
        self.cfg.seq as i64
    }

    fn session(&self, optim: Optim) -> Result<Session<B>, Error> {
        let model = self.model()?;
        Ok(match optim {
            Optim::AdamW => Session {
                model,
                opt: self.adamw(),
                lr: self.lr,
            },
            Optim::Sgd => Session {
                model,
                opt: Opt::Sgd(SgdConfig::new().init()),
                lr: self.sgd_lr,
            },
        })
    }

    fn batch(&self, rows: i64, salt: u64) -> Result<Tokens<B>, Error> {
        self.tokens(rows.max(0) as usize, salt)
    }

    /// Forward, backward, optimizer, loss read, sync, under `catch_oom`; the model is replaced
    /// only when all of it ran.
    fn plain_step(&self, s: &mut Session<B>, tokens: &Tokens<B>) -> Result<f64, Error> {
        catch_oom(|| {
            let _acts = self.charge.rows(tokens.dims()[0])?;
            let loss = s.model.loss(tokens.clone());
            let grads = GradientsParams::from_grads(loss.backward(), &s.model);
            let value = loss
                .try_into_data()?
                .iter::<f64>()
                .next()
                .unwrap_or(f64::NAN);
            let model = s.model.clone();
            let updated = match &mut s.opt {
                Opt::AdamW(o) => o.step(s.lr, model, grads),
                Opt::Sgd(o) => o.step(s.lr, model, grads),
            };
            Ad::<B>::sync(&self.dev)?;
            s.model = updated;
            Ok::<_, Error>(value)
        })
    }

    fn guarded_step(
        &self,
        engine: &RetryEngine,
        s: &mut Session<B>,
        tokens: &Tokens<B>,
    ) -> Result<TrainedStep, String> {
        let batch = tokens.dims()[0];
        let loss = |m: &Model<B>, chunk: &Chunk| {
            let _acts = self.charge.rows(chunk.len())?;
            Ok(m.loss(chunk_rows(tokens, chunk)?))
        };
        let (model, lr) = (&mut s.model, s.lr);
        // Each engine meets one optimizer, so one call site per engine.
        let done = match &mut s.opt {
            Opt::AdamW(o) => train_step(engine, &self.source, batch, model, o, lr, loss),
            Opt::Sgd(o) => train_step(engine, &self.source, batch, model, o, lr, loss),
        }
        .map_err(|e| e.to_string())?;
        catch_oom(|| Ad::<B>::sync(&self.dev)).map_err(|e| e.to_string())?;
        Ok(done)
    }

    /// Every float parameter's values, read to the host.
    fn params(&self, s: &Session<B>) -> Result<Vec<Vec<f32>>, String> {
        let mut c = Collect::default();
        catch_oom(|| {
            s.model.visit(&mut c);
            Ok::<_, Error>(())
        })
        .map_err(|e| e.to_string())?;
        match c.error {
            Some(e) => Err(format!("reading the parameters: {e}")),
            None => Ok(c.values),
        }
    }

    /// `‖a − b‖ / ‖a‖` and the largest `|a − b|` over every parameter (f64 sums; a NaN against
    /// a number is an infinite difference, two NaNs none).
    fn compare(&self, a: &Vec<Vec<f32>>, b: &Vec<Vec<f32>>) -> Result<(f64, f64), String> {
        if a.len() != b.len() || a.iter().zip(b).any(|(x, y)| x.len() != y.len()) {
            return Err("the two models have different parameters".into());
        }
        let (mut d2, mut n2, mut max) = (0f64, 0f64, 0f64);
        for (x, y) in a.iter().zip(b) {
            for (&x, &y) in x.iter().zip(y) {
                let (x, y) = (f64::from(x), f64::from(y));
                let d = match (x.is_nan(), y.is_nan()) {
                    (false, false) => (x - y).abs(),
                    (true, true) => 0.0,
                    _ => f64::INFINITY,
                };
                max = max.max(d);
                d2 += d * d;
                n2 += if x.is_nan() { 0.0 } else { x * x };
            }
        }
        Ok(((d2 / n2.max(f64::MIN_POSITIVE)).sqrt(), max))
    }

    /// Parameter elements that are a NaN or an infinity.
    fn non_finite_params(&self, s: &Session<B>) -> Result<i64, String> {
        Ok(self
            .params(s)?
            .iter()
            .flatten()
            .filter(|v| !v.is_finite())
            .count() as i64)
    }

    /// `oomguard_burn::find_max_batch`: cubecl's out-of-memory panics caught.
    fn find_max_batch(
        &self,
        opts: FinderOptions,
        step: &mut dyn FnMut(usize) -> Result<f64, Error>,
    ) -> Result<FinderReport, FinderError<Error>> {
        oomguard_burn::find_max_batch(&*self.source, opts, step)
    }
}

/// The short kind of an error: `DevicePanic`, `Execution`, `Oomguard`, ...
pub fn err_kind(e: &Error) -> &'static str {
    match e {
        Error::Execution(_) => "Execution",
        Error::DevicePanic { .. } => "DevicePanic",
        Error::Oomguard(_) => "Oomguard",
        Error::Rows(_) => "Rows",
        Error::Loss(_) => "Loss",
        Error::NoGradient { .. } => "NoGradient",
        Error::BrokenParameters { .. } => "BrokenParameters",
        Error::NothingToTrain { .. } => "NothingToTrain",
        _ => "other",
    }
}

/// A guarded step's report on `line`: retries, plans, whether the plan was remembered, the
/// attempts, the step's seconds.
pub fn with_report(line: Line, r: &RetryReport) -> Line {
    line.int("retries", r.retries() as i64)
        .text("initial_plan", plan_str(&r.initial_plan))
        .text("final_plan", plan_str(&r.final_plan))
        .flag("from_memory", r.from_memory)
        .text("attempts", attempts_str(r))
        .float("step_secs", r.elapsed.as_secs_f64(), 3)
}

/// The source's usage on `line` (bytes in use, their peak, reserved), or its error.
pub fn with_usage(line: Line, source: &dyn MemorySource) -> Line {
    match source.usage() {
        Ok(u) => line
            .int("used", u.used as i64)
            .int("peak_used", u.used_peak as i64)
            .int("reserved", u.reserved as i64),
        Err(e) => line.text("usage_error", one_line(&e.to_string())),
    }
}
