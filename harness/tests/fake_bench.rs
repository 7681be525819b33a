//! The phases over a fake framework on the runtime's simulated card: a linear model
//! (`loss = ½(w·x − y)²` per row), each forward holding 2 MiB of a 64 MiB card per row (so a
//! plain step of more than 29 rows runs out of memory), its guarded step the runtime's generic
//! `train_step` over the fake's `TrainFramework`/`TrainUpdate`. Knobs break the fake the way a
//! framework's glue could break, and the phases must say so.

use std::cell::Cell;
use std::sync::Arc;

use oomguard_harness::{parse, Bench, NoOptions, Optim, Outcome, Parsed, Runner, Sink, Spec};
use oomguard_runtime::retry::{
    find_max_batch, Chunk, FinderError, FinderOptions, FinderReport, RetryEngine,
};
use oomguard_runtime::train::{
    train_step, Gradients, LossSum, TrainFramework, TrainUpdate, TrainedStep,
};
use oomguard_runtime::{ByteSize, Device, DeviceBuffer, Error, MemorySource};

const DIM: usize = 3;
const PER_ROW: usize = 2 << 20;
const CARD_MIB: u64 = 58;
/// The largest plain step: every row's 2 MiB on the card at once.
const TRUE_MAX: i64 = (CARD_MIB << 20) as i64 / PER_ROW as i64;

type Row = ([f64; DIM], f64);

struct Fake {
    card: Device,
    source: Arc<dyn MemorySource>,
    /// The guarded step adds the chunks' gradients without their weights (a broken glue).
    unweighted: bool,
    /// The guarded step is the plain step: no engine, no split.
    unguarded: bool,
    /// After the finder's search, every plain step keeps 2 MiB of the card for good (a leak:
    /// later steps run out).
    leaks: bool,
    leaking: Cell<bool>,
}

impl Fake {
    fn new() -> Self {
        let card = Device::sim(ByteSize::mib(CARD_MIB));
        let source: Arc<dyn MemorySource> = Arc::new(card.clone());
        Self {
            card,
            source,
            unweighted: false,
            unguarded: false,
            leaks: false,
            leaking: Cell::new(false),
        }
    }
}

struct Session {
    w: Vec<f64>,
    optim: Optim,
    m: Vec<f64>,
    v: Vec<f64>,
    t: i32,
    leaked: Vec<DeviceBuffer<u8>>,
}

impl Session {
    fn update(&mut self, g: &[f64]) {
        match self.optim {
            Optim::Sgd => {
                for (w, g) in self.w.iter_mut().zip(g) {
                    *w -= 0.05 * g;
                }
            }
            Optim::AdamW => {
                self.t += 1;
                let (b1, b2, lr) = (0.9f64, 0.999f64, 3e-4);
                let t = self.t;
                for (((w, m), v), g) in self.w.iter_mut().zip(&mut self.m).zip(&mut self.v).zip(g) {
                    *m = b1 * *m + (1.0 - b1) * g;
                    *v = b2 * *v + (1.0 - b2) * g * g;
                    let mh = *m / (1.0 - b1.powi(t));
                    let vh = *v / (1.0 - b2.powi(t));
                    *w -= lr * (mh / (vh.sqrt() + 1e-8) + 0.01 * *w);
                }
            }
        }
    }
}

/// The mean loss and gradient of `rows`, holding their activations on `card` meanwhile.
fn forward(card: &Device, w: &[f64], rows: &[Row]) -> Result<(f64, Vec<f64>), Error> {
    let _activations: DeviceBuffer<u8> = card.alloc(rows.len() * PER_ROW)?;
    let (mut loss, mut g) = (0.0, vec![0.0; DIM]);
    for (x, y) in rows {
        let r = w.iter().zip(x).map(|(w, x)| w * x).sum::<f64>() - y;
        loss += 0.5 * r * r;
        for i in 0..DIM {
            g[i] += r * x[i];
        }
    }
    let n = rows.len() as f64;
    Ok((loss / n, g.into_iter().map(|g| g / n).collect()))
}

/// The fake's side of the training-step contract.
struct FakeStep<'a> {
    card: &'a Device,
    session: &'a mut Session,
    unweighted: bool,
}

impl TrainFramework for FakeStep<'_> {
    type Error = Error;
    type Batch = [Row];
    type Loss = (f64, Vec<f64>);
    type Accumulator = (LossSum, Vec<f64>);
    type Grads = Vec<f64>;

    fn batch_rows(&self, batch: &[Row]) -> Result<Option<usize>, String> {
        Ok(Some(batch.len()))
    }
    fn chunk_loss(&mut self, batch: &[Row], chunk: &Chunk) -> Result<Self::Loss, Error> {
        forward(self.card, &self.session.w, &batch[chunk.rows()])
    }
    fn accumulator(&mut self) -> Result<Self::Accumulator, Error> {
        Ok((LossSum::new(), vec![0.0; DIM]))
    }
    fn backward(
        &self,
        acc: &mut Self::Accumulator,
        loss: Self::Loss,
        c: &Chunk,
    ) -> Result<(), Error> {
        acc.0.admit(c).map_err(Error::InvalidArgument)?;
        acc.0.add_mean(c, loss.0);
        let weight = if self.unweighted { 1.0 } else { c.weight() };
        for (a, g) in acc.1.iter_mut().zip(loss.1) {
            *a += weight * g;
        }
        Ok(())
    }
    fn gradients(&self, acc: Self::Accumulator) -> Result<Gradients<Vec<f64>>, Error> {
        acc.0.covers_batch().map_err(Error::InvalidArgument)?;
        Ok(Gradients {
            grads: acc.1,
            loss: acc.0.loss(),
            rows: acc.0.rows(),
        })
    }
    fn batch_error(message: String) -> Error {
        Error::InvalidArgument(message)
    }
}

impl TrainUpdate for FakeStep<'_> {
    type Updated = ();
    fn update(&mut self, grads: Vec<f64>) -> Result<(), Error> {
        self.session.update(&grads);
        Ok(())
    }
}

impl Bench for Fake {
    type Error = Error;
    type Session = Session;
    type Batch = Vec<Row>;
    type Params = Vec<f64>;

    fn source(&self) -> &Arc<dyn MemorySource> {
        &self.source
    }
    fn row_len(&self) -> i64 {
        1
    }
    fn session(&self, optim: Optim) -> Result<Session, Error> {
        Ok(Session {
            w: vec![0.5, -0.25, 1.0],
            optim,
            m: vec![0.0; DIM],
            v: vec![0.0; DIM],
            t: 0,
            leaked: Vec::new(),
        })
    }
    fn batch(&self, rows: i64, salt: u64) -> Result<Vec<Row>, Error> {
        // A fixed target w* = (1, 2, -1) seen through seeded inputs.
        let mut state = salt.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % 2000) as f64 / 1000.0 - 1.0
        };
        Ok((0..rows)
            .map(|_| {
                let x = [next(), next(), next()];
                (x, x[0] + 2.0 * x[1] - x[2])
            })
            .collect())
    }
    fn plain_step(&self, s: &mut Session, b: &Vec<Row>) -> Result<f64, Error> {
        let (loss, g) = forward(&self.card, &s.w, b)?;
        if self.leaking.get() {
            s.leaked.push(self.card.alloc(PER_ROW)?);
        }
        s.update(&g);
        Ok(loss)
    }
    fn guarded_step(
        &self,
        engine: &RetryEngine,
        s: &mut Session,
        b: &Vec<Row>,
    ) -> Result<TrainedStep, String> {
        if self.unguarded {
            // Only its failure is looked at: it has no report to give.
            self.plain_step(s, b).map_err(|e| e.to_string())?;
            return Err("the unguarded fake ran the batch whole".into());
        }
        let mut step = FakeStep {
            card: &self.card,
            session: s,
            unweighted: self.unweighted,
        };
        train_step(engine, &self.source, &mut step, &b[..])
            .map(|done| done.step)
            .map_err(|e| e.to_string())
    }
    fn params(&self, s: &Session) -> Result<Vec<f64>, String> {
        Ok(s.w.clone())
    }
    fn compare(&self, a: &Vec<f64>, b: &Vec<f64>) -> Result<(f64, f64), String> {
        if a.len() != b.len() {
            return Err("different parameters".into());
        }
        let d2: f64 = a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum();
        let n2: f64 = a.iter().map(|x| x * x).sum();
        let max = a
            .iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f64::max);
        Ok(((d2 / n2.max(f64::MIN_POSITIVE)).sqrt(), max))
    }
    fn non_finite_params(&self, s: &Session) -> Result<i64, String> {
        Ok(s.w.iter().filter(|w| !w.is_finite()).count() as i64)
    }
    fn find_max_batch(
        &self,
        opts: FinderOptions,
        step: &mut dyn FnMut(usize) -> Result<f64, Error>,
    ) -> Result<FinderReport, FinderError<Error>> {
        let found = find_max_batch(&*self.source, opts, step);
        self.leaking.set(self.leaks);
        found
    }
}

const SPEC: Spec = Spec {
    program: "fake",
    usage: "usage: fake --phase NAME\n",
    all_phases: &["plain", "equiv", "finder", "oom", "overhead"],
    extra_phases: &["max", "mine"],
    allocators: &["native"],
    max_cap: (4096, 1024),
    defaults: &[],
    positional: false,
    default_phases: &[],
};

fn runner(fake: Fake, cli: &str) -> Runner<Fake> {
    let raw: Vec<String> = cli.split_whitespace().map(String::from).collect();
    let Ok(Parsed::Run(args, NoOptions {})) = parse(&raw, &SPEC) else {
        panic!("the test's command line {cli:?} did not parse");
    };
    let mut r = Runner::new(fake, *args);
    r.out.sink = Sink::Capture(Vec::new());
    r
}

fn lines(r: &Runner<Fake>) -> &[String] {
    match &r.out.sink {
        Sink::Capture(l) => l,
        Sink::Stdout => &[],
    }
}

/// Every output line that starts with `prefix`.
fn lines_with<'a>(r: &'a Runner<Fake>, prefix: &str) -> Vec<&'a String> {
    lines(r).iter().filter(|l| l.starts_with(prefix)).collect()
}

/// The value of `key=` in a `key=value` line (up to the next space).
fn field<'a>(line: &'a str, key: &str) -> &'a str {
    line.split(&format!(" {key}="))
        .nth(1)
        .and_then(|v| v.split(' ').next())
        .unwrap_or_else(|| panic!("no {key}= in {line}"))
}

fn line<'a>(r: &'a Runner<Fake>, prefix: &str) -> &'a str {
    lines(r)
        .iter()
        .find(|l| l.starts_with(prefix))
        .unwrap_or_else(|| panic!("no line {prefix:?} in {:#?}", lines(r)))
}

#[test]
fn max_finds_the_largest_batch_the_card_holds() {
    let mut r = runner(Fake::new(), "--phase max --device cpu");
    assert_eq!(r.max_phase(), Ok(Outcome::Pass));
    assert_eq!(r.max, Some(TRUE_MAX));
    let l = line(&r, "RESULT phase=max");
    assert!(
        l.contains(&format!("max_batch={TRUE_MAX} reached_max_cap=false")),
        "{l}"
    );
    // A failed trial says why (the card's out-of-memory).
    assert!(lines(&r)
        .iter()
        .any(|l| l.starts_with("TRIAL phase=max") && l.contains("ok=false")));
}

#[test]
fn max_stops_at_the_cap_when_every_batch_runs() {
    let mut r = runner(Fake::new(), "--phase max --max-cap 5");
    assert_eq!(r.max_phase(), Ok(Outcome::Pass));
    assert_eq!(r.max, Some(5));
    assert!(line(&r, "RESULT phase=max").contains("max_batch=5 reached_max_cap=true trials=4"));
}

/// `--oom-steps` sets how many guarded steps `oom` runs; each `STEP` line says what the source
/// did in it, and the `RESULT` line has the first step's time and the later steps' median.
#[test]
fn oom_runs_the_steps_asked_for_and_says_what_the_source_did() {
    let mut r = runner(Fake::new(), "--phase oom --oom-steps 6");
    assert_eq!(r.oom(), Ok(Outcome::Pass));
    let steps = lines_with(&r, "STEP phase=oom");
    assert_eq!(steps.len(), 6, "{steps:#?}");
    for (i, l) in steps.iter().enumerate() {
        assert!(l.contains(&format!("step={} ", i + 1)), "{l}");
        for key in ["alloc_retries=", "unmaps=", "unmapped=", "syncs="] {
            assert!(l.contains(key), "{key} in {l}");
        }
    }
    let l = line(&r, "RESULT phase=oom");
    assert!(
        l.contains("step1_secs=") && l.contains("later_median_secs="),
        "{l}"
    );
    assert_eq!(field(l, "losses").split(',').count(), 6, "six losses: {l}");
    // the whole batch (1 x 58, out of memory as a plain step), the settled plan (2 x 29) and the
    // next finer split (4 x 15), timed as plain steps
    let splits = lines_with(&r, "TRIAL phase=oom");
    assert_eq!(splits.len(), 3, "{splits:#?}");
    assert!(
        splits[0].contains("split=1x58 micro_batch=58 chunks=1 out_of_memory=true"),
        "{}",
        splits[0]
    );
    assert!(
        splits[1].contains("split=2x29 micro_batch=29 chunks=2 ms="),
        "{}",
        splits[1]
    );
    assert!(
        splits[2].contains("split=4x15 micro_batch=15 chunks=4 ms="),
        "{}",
        splits[2]
    );
    assert!(
        l.contains("split_ms=1x58:oom,2x29:") && l.contains(",4x15:"),
        "{l}"
    );
    let ratio: f64 = field(l, "settled_over_fastest_split")
        .parse()
        .unwrap_or_else(|_| panic!("no ratio in {l}"));
    assert!(ratio.is_finite() && ratio > 0.0, "{l}");
}

#[test]
fn oom_survives_twice_the_largest_batch_by_splitting_it() {
    let mut r = runner(Fake::new(), "--phase oom");
    assert_eq!(r.oom(), Ok(Outcome::Pass));
    let l = line(&r, "RESULT phase=oom");
    assert!(
        l.contains(&format!("max={TRUE_MAX} batch={}", 2 * TRUE_MAX)),
        "{l}"
    );
    assert!(
        l.contains("later_steps_from_plan_no_retry=true every_row_trained=true"),
        "{l}"
    );
    assert!(!l.contains("step1_retries=0 "), "{l}");
    assert_eq!(
        lines(&r)
            .iter()
            .filter(|l| l.starts_with("STEP phase=oom"))
            .count(),
        4
    );
}

#[test]
fn oom_is_an_error_when_the_guarded_step_does_not_split() {
    let mut fake = Fake::new();
    fake.unguarded = true;
    let mut r = runner(fake, "--phase oom --max 29");
    let e = r.oom().unwrap_err();
    assert!(e.contains("train_step, step 1 of batch 58"), "{e}");
}

#[test]
fn oom_runs_a_given_batch_without_measuring_the_max() {
    let mut r = runner(Fake::new(), "--phase oom --oom-batch 40");
    assert_eq!(r.oom(), Ok(Outcome::Pass));
    assert!(!lines(&r).iter().any(|l| l.starts_with("TRIAL phase=max")));
    assert!(line(&r, "RESULT phase=oom").contains("max=39 batch=40 step1_retries=1"));
}

#[test]
fn equiv_holds_for_weighted_chunks_and_fails_for_unweighted_ones() {
    let mut r = runner(Fake::new(), "--phase equiv");
    assert_eq!(r.equiv(), Ok(Outcome::Pass));
    assert!(line(&r, "RESULT phase=equiv opt=sgd").contains("plans=1x8_vs_4x2"));
    assert!(line(&r, "RESULT phase=equiv opt=adamw").contains("via=train_step"));

    let mut fake = Fake::new();
    fake.unweighted = true;
    let mut r = runner(fake, "--phase equiv");
    assert_eq!(r.equiv(), Ok(Outcome::Fail));
}

#[test]
fn finder_finds_a_batch_that_runs_and_compares_it_with_the_true_max() {
    let mut r = runner(Fake::new(), "--phase finder --find-steps 5");
    assert_eq!(r.finder(), Ok(Outcome::Pass));
    let l = line(&r, "RESULT phase=finder batch=");
    assert!(
        l.contains("steps=5 ooms=0") && l.contains("pattern=....."),
        "{l}"
    );
    assert!(line(&r, "RESULT phase=finder found=").contains("found="));
    assert!(line(&r, "RESULT phase=finder found=").len() > 20);
    assert!(lines(&r)
        .iter()
        .any(|l| l.contains(&format!("true_max={TRUE_MAX}"))));
}

#[test]
fn finder_fails_when_steps_at_the_found_batch_run_out() {
    let mut fake = Fake::new();
    fake.leaks = true;
    let mut r = runner(fake, "--phase finder --find-steps 40 --max 29");
    assert_eq!(r.finder(), Ok(Outcome::Fail));
    let l = line(&r, "RESULT phase=finder batch=");
    assert!(l.contains("pattern=") && l.ends_with('X'), "{l}");
    assert!(!l.contains("ooms=0"), "{l}");
}

#[test]
fn plain_and_overhead_time_their_steps() {
    let mut r = runner(
        Fake::new(),
        "--phase plain --steps 4 --warmup 1 --overhead-rounds 2",
    );
    assert_eq!(r.plain(), Ok(Outcome::Pass));
    assert_eq!(
        lines(&r)
            .iter()
            .filter(|l| l.starts_with("STEP phase=plain"))
            .count(),
        5
    );
    let l = line(&r, "RESULT phase=plain");
    // 8 rows of 2 MiB each step: the card's peak.
    assert!(l.contains(&format!("peak_used={}", 8 * PER_ROW)), "{l}");
    assert_eq!(r.overhead(), Ok(Outcome::Pass));
    assert!(line(&r, "RESULT phase=overhead").contains("batch=8 steps_each=10"));
}

#[test]
fn run_ends_each_phase_with_its_line_and_fails_on_a_failed_check() {
    let mut fake = Fake::new();
    fake.unweighted = true;
    let mut r = runner(fake, "--phase mine,equiv --json");
    let mut own_asked = Vec::new();
    let code = r.run(|r, name| {
        own_asked.push(name.to_string());
        (name == "mine").then(|| {
            r.emit(oomguard_harness::Line::result("mine").int("x", 1));
            Ok(Outcome::Pass)
        })
    });
    // The example is asked first about every phase; `equiv` it leaves to the harness.
    assert_eq!(own_asked, ["mine", "equiv"]);
    assert_eq!(code, std::process::ExitCode::FAILURE);
    let phases: Vec<serde_json::Value> = lines(&r)
        .iter()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .filter(|v: &serde_json::Value| v["kind"] == "PHASE")
        .collect();
    assert_eq!(phases.len(), 2);
    assert_eq!(phases[0]["phase"], "mine");
    assert_eq!(phases[0]["status"], "ok");
    assert_eq!(phases[1]["phase"], "equiv");
    assert_eq!(phases[1]["status"], "FAIL");
}

#[test]
fn run_succeeds_when_every_phase_passes() {
    let mut r = runner(
        Fake::new(),
        "--phase all --find-steps 3 --steps 2 --overhead-rounds 1",
    );
    let code = r.run(|_, _| None);
    let statuses = lines_with(&r, "PHASE");
    assert_eq!(statuses.len(), 5, "{statuses:#?}");
    assert!(
        statuses.iter().all(|l| l.contains("status=ok")),
        "{statuses:#?}"
    );
    assert_eq!(code, std::process::ExitCode::SUCCESS);
}
