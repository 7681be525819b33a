//! `#[oom_retry]`'s glue: the generated loop drives a [`Retry`], which drives the retry
//! engine's [`RetryLoop`] on every device (the function holds no `Device`).

use std::fmt;
use std::ops::ControlFlow;
use std::sync::OnceLock;

use super::engines::engine_for;
use crate::retry::advanced::RetryLoop;
use crate::retry::advanced::{EmptyCacheRetry, KeepsRows, PolicyExt, Shrink, SiteMemo, StepMode};
use crate::retry::{Accumulate, BatchPlan, IsOom, RetryEngine, RetryError, RetryPolicy};

/// Where the function is.
#[derive(Clone, Copy, Debug)]
pub struct Site {
    /// `file!()`
    pub file: &'static str,
    /// `line!()` of the function's name
    pub line: u32,
    /// The function's name.
    pub function: &'static str,
    /// `file:line function`, made at compile time: the memory key of the function.
    pub key: &'static str,
    /// The generic instance (`type_name` of the function's type parameters), `""` for a
    /// function without any: plans of `step::<f32>` and `step::<f64>` are remembered apart.
    pub instance: &'static str,
}

/// What the retry controls.
#[derive(Clone, Debug)]
pub enum RetryKind {
    /// Nothing: retry after emptying the cache only.
    Plain,
    /// `batch = param`: the batch size, shrunk on OOM (halved down to `min`).
    Batch(u64),
    /// `plan = param`: a [`BatchPlan`], split into smaller micro-batches on OOM (down to `min`).
    Plan(BatchPlan),
}

/// The options of `#[oom_retry]`.
pub struct RetryConfig {
    /// The function.
    pub site: Site,
    /// What is retried.
    pub kind: RetryKind,
    /// `min`: the smallest batch (`batch`) or micro-batch (`plan`).
    pub min: Option<u64>,
    /// `max_retries` (default 16).
    pub max_retries: Option<u64>,
    /// `remember` (default true): start from the plan that worked last time.
    pub remember: Option<bool>,
    /// `persist`: a JSON file to remember plans in across runs.
    pub persist: Option<&'static str>,
    /// `policy`: replaces the built-in policy (`min` and `max_retries` still apply).
    pub policy: Option<Box<dyn RetryPolicy>>,
    /// `#[no_grad]` is on the function: the step evaluates whatever the caller's grad mode.
    pub no_grad: bool,
}

/// `policy = EXPR`.
pub fn boxed_policy(p: impl RetryPolicy + 'static) -> Box<dyn RetryPolicy> {
    Box::new(p)
}

/// A by-value parameter, cloned for each attempt.
pub fn clone_for_retry<T: Clone>(v: &T) -> T {
    v.clone()
}

/// The integer types `batch = param` accepts.
pub trait BatchInt: Copy {
    /// As a `u64`.
    fn to_u64(self) -> u64;
    /// From a `u64` (saturating).
    fn from_u64(v: u64) -> Self;
}
macro_rules! batch_ints {
    ($($t:ty),*) => {$(
        impl BatchInt for $t {
            fn to_u64(self) -> u64 {
                u64::try_from(self).unwrap_or(0)
            }
            fn from_u64(v: u64) -> Self {
                <$t>::try_from(v).unwrap_or(<$t>::MAX)
            }
        }
    )*};
}
batch_ints!(u8, u16, u32, u64, usize);

fn policy_for(cfg: &mut RetryConfig, mode: StepMode) -> Box<dyn RetryPolicy> {
    let min = cfg
        .min
        .map_or(1, |m| usize::try_from(m).unwrap_or(usize::MAX));
    let max = cfg
        .max_retries
        .map_or(16, |m| u32::try_from(m).unwrap_or(u32::MAX));
    let (min_micro, min_batch) = match cfg.kind {
        RetryKind::Plan(_) => (min, 1),
        _ => (1, min),
    };
    match (cfg.policy.take(), &cfg.kind) {
        // A training step is never shrunk, by a policy of the user's either.
        (Some(p), _) if mode == StepMode::Train => Box::new(
            KeepsRows::new(p)
                .hint("Use an `Accumulate` policy (or `plan =`), or `#[no_grad]` for evaluation")
                .with_floor(min_micro, min_batch)
                .max_retries(max),
        ),
        (Some(p), _) => Box::new(p.with_floor(min_micro, min_batch).max_retries(max)),
        // The same call again only helps once the cache is empty: once, unless told otherwise.
        (None, RetryKind::Plain) => Box::new(EmptyCacheRetry::times(
            cfg.max_retries
                .map_or(1, |m| u32::try_from(m).unwrap_or(u32::MAX)),
        )),
        // A training step is never shrunk silently: dropping rows changes what it computes.
        (None, RetryKind::Batch(_)) if mode == StepMode::Train => {
            Box::new(EmptyCacheRetry::once().max_retries(max))
        }
        (None, RetryKind::Batch(_)) => Box::new(
            EmptyCacheRetry::once()
                .then(Shrink::halving().min_batch(min))
                .max_retries(max),
        ),
        (None, RetryKind::Plan(_)) => Box::new(
            EmptyCacheRetry::once()
                .then(Accumulate::halving().min_micro_batch(min))
                .max_retries(max),
        ),
    }
}

/// An error-level message users must see: through `tracing`, and on standard error when no
/// `tracing` subscriber is installed (as leak reports do).
fn warn_visibly(msg: &str) {
    tracing::error!(target: "oomguard::retry", "{msg}");
    if !tracing::dispatcher::has_been_set() {
        eprintln!("oomguard error: {msg}");
    }
}

/// The `Ok` and `Err` types of a function's `Result` return type, written or aliased
/// (`io::Result<T>`, `anyhow::Result<T>`): the attempt of a function with a commit phase
/// returns `Result<_, <Ret as FnResult>::Err>`.
#[diagnostic::on_unimplemented(
    message = "#[oom_retry] and #[leak_check(action = error)] need a function returning a `Result`, not `{Self}`"
)]
pub trait FnResult {
    /// The error type.
    type Err;
}
impl<T, E> FnResult for Result<T, E> {
    type Err = E;
}

/// What a `#[oom_retry]` function keeps across calls (a `static` in its body): its engines,
/// one per mode, with their policies, built on the first call, and for each whether anything is
/// remembered for the function. Used when the function has no `policy` option (an expression
/// evaluated at each call) and remembers plans.
#[derive(Debug)]
pub struct SiteCache {
    engines: OnceLock<[RetryEngine; 2]>,
    /// For each engine: whether nothing was remembered for the function, as of which plan
    /// memory generation and device (the first attempt then runs without a loop set up).
    memos: [SiteMemo; 2],
}

impl SiteCache {
    /// An empty cache.
    pub const fn new() -> Self {
        Self {
            engines: OnceLock::new(),
            memos: [SiteMemo::new(), SiteMemo::new()],
        }
    }
}

impl Default for SiteCache {
    fn default() -> Self {
        Self::new()
    }
}

fn build_engine(cfg: &mut RetryConfig, mode: StepMode) -> RetryEngine {
    let policy = policy_for(cfg, mode);
    let mut engine = if cfg.remember == Some(false) {
        RetryEngine::new()
    } else {
        engine_for(cfg.persist)
    };
    engine = engine.with_policy(policy);
    if cfg.no_grad {
        engine = engine.with_mode_hook(|| StepMode::Eval);
    }
    engine
}

/// The retry loop of one call of a `#[oom_retry]` function.
pub struct Retry<E> {
    lp: Option<RetryLoop<E>>,
    kind: RetryKind,
    site: &'static str,
    /// Rows the caller asked for.
    requested: usize,
    /// `batch =` on a training step: the batch is not shrunk (say so when giving up).
    train_batch: bool,
}

// The bounds are on the methods, not the impl: a step whose error type lacks `IsOom` then
// gets `IsOom`'s own diagnostic (which names the `anyhow` feature), not "method not found".
impl<E> Retry<E> {
    /// Starts the loop for one call.
    pub fn new(mut cfg: RetryConfig, cache: &SiteCache) -> Self
    where
        E: IsOom + fmt::Display,
    {
        // The mode inside the function: `#[no_grad]` on it applies to each attempt, after this.
        let mode = if cfg.no_grad {
            StepMode::Eval
        } else {
            StepMode::current()
        };
        let train_batch = mode == StepMode::Train
            && matches!(cfg.kind, RetryKind::Batch(_))
            && cfg.policy.is_none();
        let owned;
        let mode_index = usize::from(mode == StepMode::Eval);
        let cached = cfg.policy.is_none() && cfg.remember != Some(false);
        let engine: &RetryEngine = if cached {
            let engines = cache.engines.get_or_init(|| {
                [
                    build_engine(&mut cfg, StepMode::Train),
                    build_engine(&mut cfg, StepMode::Eval),
                ]
            });
            &engines[mode_index]
        } else {
            owned = build_engine(&mut cfg, mode);
            &owned
        };
        let start = match &cfg.kind {
            RetryKind::Plain => BatchPlan::whole(1),
            RetryKind::Batch(n) => BatchPlan::whole(usize::try_from(*n).unwrap_or(usize::MAX)),
            RetryKind::Plan(p) => Ok(*p),
        };
        let site = cfg.site.key;
        // A batch of 0 rows: nothing to plan, the body runs once as written (and the thread's
        // last report is not the previous call's).
        let lp = match start {
            // A plain (not generic) function on an engine it keeps: the first attempt starts
            // without a loop while nothing is remembered for it.
            Ok(s) if cached && cfg.site.instance.is_empty() => engine
                .begin_any_memo(site, s, &cache.memos[mode_index])
                .ok(),
            Ok(s) => {
                let key = if cfg.site.instance.is_empty() {
                    site.to_string()
                } else {
                    format!("{site}<{}>", cfg.site.instance)
                };
                engine.begin_any(key, s).ok()
            }
            Err(_) => None,
        };
        if lp.is_none() {
            crate::retry::clear_last_report();
        }
        let requested = start.map_or(0, |s| s.batch());
        Retry {
            lp,
            kind: cfg.kind,
            site,
            requested,
            train_batch,
        }
    }

    /// The batch size for this attempt (`batch = param`).
    pub fn batch(&self) -> u64 {
        match (&self.lp, &self.kind) {
            (Some(lp), _) => lp.batch() as u64,
            (None, RetryKind::Batch(n)) => *n,
            (None, _) => 0,
        }
    }

    /// The plan for this attempt (`plan = param`).
    pub fn plan(&self) -> BatchPlan {
        match (&self.lp, &self.kind) {
            (Some(lp), _) => lp.plan(),
            (None, RetryKind::Plan(p)) => *p,
            (None, _) => BatchPlan::whole(1).expect("1 row is a plan"),
        }
    }

    /// The commit phase starts: enclosing retry loops on this thread must not rerun it.
    pub fn commit_starting(&self) {
        crate::retry::note_commit();
    }

    /// The commit phase ended with `out`. It ran once and is never retried: an error (an
    /// out-of-memory included) is the function's error, logged, recorded in
    /// [`last_report`](crate::retry::last_report) as the commit's, and marked
    /// ([`IsOom::after_commit`]) so that no outer layer retries it.
    pub fn committed<T>(&self, out: Result<T, E>) -> Result<T, E>
    where
        E: IsOom + fmt::Display,
    {
        let e = match out {
            Ok(v) => return Ok(v),
            Err(e) => e,
        };
        let oom = e.is_oom();
        tracing::error!(
            target: "oomguard::retry",
            site = self.site,
            oom,
            error = %e,
            "the commit phase failed; it is not retried (it runs once)"
        );
        let report = self.lp.as_ref().and_then(|lp| {
            crate::retry::record_commit_error(&lp.report().site, e.to_string(), oom)
        });
        match report {
            Some(r) => Err(e.after_commit(&r)),
            // no loop (a batch of 0 rows): nothing to report, still never retryable on this
            // thread (the commit was noted)
            None => Err(e),
        }
    }

    /// Takes an attempt's outcome: `Break` with the function's result, or `Continue` to run the
    /// body again with [`Retry::batch`] / [`Retry::plan`].
    pub fn next<T>(&mut self, out: Result<T, E>) -> ControlFlow<Result<T, E>>
    where
        E: IsOom + fmt::Display,
    {
        let Some(lp) = self.lp.as_mut() else {
            return ControlFlow::Break(out);
        };
        match lp.next_value(out) {
            ControlFlow::Continue(()) => ControlFlow::Continue(()),
            ControlFlow::Break(Ok(v)) => {
                let rows = lp.plan().batch();
                if rows < self.requested {
                    // `batch =` on an evaluation step: the caller asked for shrinking, and sees it.
                    tracing::warn!(
                        target: "oomguard::retry",
                        site = self.site,
                        rows,
                        requested = self.requested,
                        "out of memory: processed {rows} of {} rows (the batch was shrunk; \
                         `last_report()` has the plan)",
                        self.requested
                    );
                }
                ControlFlow::Break(Ok(v))
            }
            ControlFlow::Break(Err(mut e)) => {
                if self.train_batch && e.is_oom() {
                    let hint = "`batch =` does not shrink a step with gradients on (it would \
                                train on fewer rows); use `plan =` to accumulate micro-batches, \
                                or `#[no_grad]` for evaluation";
                    warn_visibly(&format!(
                        "{}: out of memory in a training step: {hint}",
                        self.site
                    ));
                    // in the returned error too (its report), and in `last_report`
                    if let RetryError::GaveUp { report, .. } = &mut e {
                        report.hint = Some(hint.to_string());
                        crate::retry::record_hint(&report.site, hint.to_string());
                    }
                }
                // One process, so the step ended with this rank's own error (a non-OOM error or
                // the last OOM): give it back as the function's error.
                let msg = e.to_string();
                match e.into_error() {
                    Some(err) => ControlFlow::Break(Err(err)),
                    None => unreachable!("a single-process retry ends with its own error: {msg}"),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ByteSize, Device, Error};

    /// A body that needs 1 MiB a row, on a device of 24 MiB: 16 rows fit, 32 do not.
    fn rows(dev: &Device, n: u64) -> Result<u64, Error> {
        dev.alloc::<u8>(usize::try_from(n << 20).unwrap())?;
        Ok(n)
    }

    fn config(function: &'static str, kind: RetryKind, no_grad: bool) -> RetryConfig {
        RetryConfig {
            site: Site {
                file: file!(),
                line: line!(),
                function,
                key: function,
                instance: "",
            },
            kind,
            min: None,
            max_retries: Some(6),
            remember: Some(false),
            persist: None,
            policy: None,
            no_grad,
        }
    }

    /// Drives the loop as the generated code does. Returns the outcome and every batch tried.
    fn drive(mut r: Retry<Error>) -> (Result<u64, Error>, Vec<u64>) {
        let dev = Device::sim(ByteSize::mib(24));
        let mut tried = Vec::new();
        loop {
            let n = r.batch();
            tried.push(n);
            let out = rows(&dev, n);
            if let ControlFlow::Break(out) = r.next(out) {
                return (out, tried);
            }
        }
    }

    #[test]
    fn an_evaluation_batch_is_halved_until_it_fits() {
        let r = Retry::new(
            config("eval_step", RetryKind::Batch(64), true),
            &SiteCache::new(),
        );
        let (out, tried) = drive(r);
        assert_eq!(out.unwrap(), 16);
        // halved (64 rows need more than the device holds: no same-batch retry first)
        assert_eq!(tried, [64, 32, 16]);
    }

    /// `max_retries` stops the halving, and the report says that the limit did.
    #[test]
    fn the_retry_limit_is_named_when_it_stops_the_step() {
        let mut cfg = config("eval_limited", RetryKind::Batch(64), true);
        cfg.max_retries = Some(1);
        let (out, tried) = drive(Retry::new(cfg, &SiteCache::new()));
        assert_eq!(tried, [64, 32]);
        let Err(Error::RetriesExhausted { report, .. }) = out else {
            panic!("expected the retries-exhausted error");
        };
        let limit = Some(crate::retry::StopReason::RetryLimit { max: 1 });
        assert_eq!(report.stopped, limit, "{report}");
    }

    #[test]
    fn a_training_batch_is_never_shrunk_and_the_error_says_why() {
        let _train = crate::guard::enable_grad();
        let r = Retry::new(
            config("train_step", RetryKind::Batch(64), false),
            &SiteCache::new(),
        );
        let (out, tried) = drive(r);
        // never 32: a training step keeps its rows (and 64 MiB can never fit: no retry)
        assert_eq!(tried, [64]);
        let Err(Error::RetriesExhausted { error, report }) = out else {
            panic!("expected the retries-exhausted error");
        };
        assert!(error.is_oom());
        assert!(report.hint.as_deref().unwrap().contains("`plan =`"));
        assert_eq!(crate::retry::last_report().unwrap().hint, report.hint);
    }

    #[test]
    fn a_plan_is_split_into_smaller_micro_batches() {
        let plan = BatchPlan::whole(64).unwrap();
        let mut r = Retry::<Error>::new(
            config("plan_step", RetryKind::Plan(plan), false),
            &SiteCache::new(),
        );
        let dev = Device::sim(ByteSize::mib(24));
        let mut micro = Vec::new();
        let total = loop {
            let p = r.plan();
            micro.push(p.micro_batch());
            let out = p
                .chunks()
                .try_fold(0, |sum, c| Ok(sum + rows(&dev, c.len() as u64)?));
            if let ControlFlow::Break(out) = r.next(out) {
                break out.unwrap();
            }
        };
        assert_eq!(total, 64); // every row still processed
        assert_eq!(micro, [64, 32, 16]);
    }

    #[test]
    fn a_batch_of_zero_rows_runs_once_without_a_loop() {
        let mut r = Retry::<Error>::new(
            config("empty_step", RetryKind::Batch(0), true),
            &SiteCache::new(),
        );
        assert_eq!(r.batch(), 0);
        // no loop: an out-of-memory is the function's error at once, not retried
        let dev = Device::sim(ByteSize::mib(24));
        let ControlFlow::Break(Err(e)) = r.next(rows(&dev, 64)) else {
            panic!("expected the error at once");
        };
        assert!(e.is_oom());
        assert!(crate::retry::last_report().is_none());
    }

    #[test]
    fn batch_integers_saturate() {
        assert_eq!(u8::from_u64(300), u8::MAX);
        assert_eq!(u16::from_u64(7), 7);
        assert_eq!(usize::MAX.to_u64(), u64::try_from(usize::MAX).unwrap());
    }
}
