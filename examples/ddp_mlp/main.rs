//! The MLP of `examples/train_mlp` trained data-parallel on GPUs with NCCL, surviving an
//! out-of-memory on one rank only. Two forms:
//!
//! - **one process per GPU**, as data-parallel training is run: started by a launcher that sets
//!   `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT` (torchrun; srun's
//!   `SLURM_*` also work). Each process drives GPU `LOCAL_RANK` and joins the group with
//!   `NcclConsensus::from_env`'s steps (a TCP rendezvous with rank 0 at `MASTER_ADDR`, port
//!   `MASTER_PORT + 1` or `OOMGUARD_RENDEZVOUS_PORT`). Picked when those variables are set.
//! - **one thread per GPU** in one process (`NcclConsensus::for_devices`): picked when no
//!   launcher variables are set, or with `--threads`.
//!
//! Each rank processes `1/world` of every global batch. A memory budget on rank 1 makes it run
//! out of memory; its retry engine and the others' agree (an NCCL max all-reduce of their flags
//! after each attempt) so all switch to the same plan, and the gradients are summed once per step,
//! in the commit, after the agreement. The run then checks that every rank ran the same plans and
//! ended with bit-identical parameters (a hash compared over NCCL in the process form), equal
//! within 1e-4 relative to a single-GPU run of the same global batch (on rank 0's GPU).
//!
//! ```text
//! torchrun --standalone --nproc-per-node 2 target/release/examples/ddp_mlp [OPTIONS]
//! cargo run --release --features nccl --example ddp_mlp -- [OPTIONS]        # threads
//!   --steps N  --batch GLOBAL  --dims A,B,..  --budget-rank1 SIZE|none  --seed S  --lr X
//!   --threads                 one process, one thread per GPU, even under a launcher
//!   --nccl-timeout SECS       the collective timeout (default OOMGUARD_NCCL_TIMEOUT or 60)
//!   --die-at-step N           make one rank fail at the start of step N, to see the others stop:
//!   --die-rank R              which rank (default 1)
//!   --die-how kill|abort|error|panic|step-error   SIGKILL itself (default), abort(), return
//!                             an error before the step, panic, or fail inside the step (the
//!                             retry engine's agreement stops the other ranks); in the threaded
//!                             form kill and abort end the whole process: use the others there
//! ```
//! Needs CUDA devices and libnccl (as `libnccl.so`); otherwise it says so in one line.

#[allow(dead_code)]
#[path = "../train_mlp/model.rs"]
mod model;
#[allow(dead_code)]
#[path = "../train_mlp/ops.rs"]
mod ops;
#[allow(dead_code)]
#[path = "../train_mlp/ops_cuda.rs"]
mod ops_cuda;
mod step;

use std::thread;
use std::time::{Duration, Instant};

use oomguard::nccl::{nccl_available, LaunchEnv, NcclConsensus};
use oomguard::retry::{
    AttemptOutcome, BatchPlan, Chunk, Consensus, GradientSync, RetryEngine, SingleProcess, Step,
};
use oomguard::{ByteSize, Device, Error};

use model::Mlp;
use ops_cuda::CudaOps;
use step::DdpStep;

/// GPUs of the threaded form.
const THREADS_WORLD: usize = 2;

/// How `--die-at-step` makes a rank fail.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum DieHow {
    /// SIGKILL to itself: no destructor runs, the kernel closes its sockets.
    Kill,
    /// `std::process::abort()`: a crash.
    Abort,
    /// The training loop returns a (non-OOM) error; the process exits 1.
    Error,
    /// The training loop panics.
    Panic,
    /// A micro-batch of the step returns a non-OOM error: the retry engine stops every rank
    /// through its agreement.
    StepError,
}

#[derive(Clone, Debug)]
struct Options {
    dims: Vec<usize>,
    batch: usize,
    steps: usize,
    seed: u64,
    lr: f32,
    budget_rank1: Option<ByteSize>,
    threads: bool,
    nccl_timeout: Option<Duration>,
    die_at_step: Option<usize>,
    die_rank: usize,
    die_how: DieHow,
}

fn parse_options() -> Result<Options, String> {
    let mut o = Options {
        dims: vec![1024, 4096, 4096, 10],
        batch: 4096,
        steps: 5,
        seed: 7,
        lr: 0.05,
        budget_rank1: Some(ByteSize::mib(64)),
        threads: false,
        nccl_timeout: None,
        die_at_step: None,
        die_rank: 1,
        die_how: DieHow::Kill,
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut val = || args.next().ok_or_else(|| format!("{a} needs a value"));
        match a.as_str() {
            "--dims" => {
                o.dims = val()?
                    .split(',')
                    .map(|d| {
                        d.trim()
                            .parse::<usize>()
                            .map_err(|_| format!("bad --dims entry {d:?}"))
                    })
                    .collect::<Result<_, _>>()?;
                if o.dims.len() < 2 || o.dims.contains(&0) {
                    return Err("--dims needs at least two positive sizes".into());
                }
            }
            "--batch" => o.batch = val()?.parse().map_err(|_| "--batch takes an integer")?,
            "--steps" => o.steps = val()?.parse().map_err(|_| "--steps takes an integer")?,
            "--seed" => o.seed = val()?.parse().map_err(|_| "--seed takes an integer")?,
            "--lr" => o.lr = val()?.parse().map_err(|_| "--lr takes a number")?,
            "--budget-rank1" => {
                let v = val()?;
                o.budget_rank1 = if v == "none" {
                    None
                } else {
                    Some(v.parse::<ByteSize>().map_err(|e| e.to_string())?)
                };
            }
            "--threads" => o.threads = true,
            "--nccl-timeout" => {
                let v: f64 = val()?.parse().map_err(|_| "--nccl-timeout takes seconds")?;
                if !(v.is_finite() && v > 0.0 && v <= 86_400.0) {
                    return Err("--nccl-timeout must be between 0 and 86400 seconds".into());
                }
                o.nccl_timeout = Some(Duration::from_secs_f64(v));
            }
            "--die-at-step" => {
                o.die_at_step = Some(val()?.parse().map_err(|_| "--die-at-step takes a step")?)
            }
            "--die-rank" => o.die_rank = val()?.parse().map_err(|_| "--die-rank takes a rank")?,
            "--die-how" => {
                o.die_how = match val()?.as_str() {
                    "kill" => DieHow::Kill,
                    "abort" => DieHow::Abort,
                    "error" => DieHow::Error,
                    "panic" => DieHow::Panic,
                    "step-error" => DieHow::StepError,
                    other => {
                        return Err(format!(
                            "--die-how: kill, abort, error, panic or step-error, not {other:?}"
                        ))
                    }
                }
            }
            "-h" | "--help" => {
                return Err(
                    "usage: ddp_mlp [--steps N] [--batch GLOBAL] [--dims A,B,..] \
                            [--budget-rank1 SIZE|none] [--seed S] [--lr X] [--threads] \
                            [--nccl-timeout SECS] [--die-at-step N [--die-rank R] \
                            [--die-how kill|abort|error|panic|step-error]]"
                        .into(),
                )
            }
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    if o.batch == 0 {
        return Err("--batch must be positive".into());
    }
    if !(o.lr.is_finite() && o.lr > 0.0) {
        return Err("--lr must be a positive number".into());
    }
    Ok(o)
}

/// What one run of one rank produced.
struct RankRun {
    plans: Vec<BatchPlan>,
    peer_ooms: usize,
    own_ooms: usize,
    params: Vec<f32>,
}

/// Trains `o.steps` steps as `rank` of `world` on `dev`, syncing gradients through `sync`.
fn train(
    o: &Options,
    dev: &Device,
    rank: usize,
    world: usize,
    sync: impl GradientSync + Clone + 'static,
    budget: Option<ByteSize>,
) -> Result<RankRun, String> {
    let ops = CudaOps::new(dev).map_err(|e| e.to_string())?;
    let mut mlp = Mlp::new(dev, &o.dims, o.seed).map_err(|e| e.to_string())?;
    let engine = RetryEngine::new().with_consensus(sync.clone());
    let local = o.batch / world;
    let label = if world == 1 {
        "single".to_string()
    } else {
        format!("rank {rank}")
    };
    let mut run = RankRun {
        plans: vec![],
        peer_ooms: 0,
        own_ooms: 0,
        params: vec![],
    };
    for s in 0..o.steps {
        let dies = o.die_at_step == Some(s) && rank == o.die_rank && world > 1;
        if dies && o.die_how != DieHow::StepError {
            die(o.die_how, &label, s)?;
        }
        let t0 = Instant::now();
        let _budget = budget.map(|b| dev.thread_budget(b));
        let step = DdpStep {
            dev,
            ops: &ops,
            mlp: &mut mlp,
            sync: &sync,
            global: o.batch,
            first_row: s * o.batch + rank * local,
            seed: o.seed,
            lr: o.lr,
            loss: 0.0,
        };
        let mut step = FailingStep {
            inner: step,
            fail: dies && o.die_how == DieHow::StepError,
        };
        let out = engine
            .run_step(dev, local, &mut step)
            .map_err(|e| format!("{label}: step {s}: {e}"))?;
        let loss = out.value.map_err(|e| format!("{label}: step {s}: {e}"))?;
        let r = &out.report;
        let count = |k| r.attempts.iter().filter(|a| a.outcome == k).count();
        run.own_ooms += count(AttemptOutcome::Oom);
        run.peer_ooms += count(AttemptOutcome::PeerOom);
        println!(
            "[{label}] {}: step {s}: plan {}  attempts {} (own OOM {}, peer OOM {})  loss {:.4}  {:.1} ms",
            dev.name(),
            r.final_plan,
            r.attempts.len(),
            count(AttemptOutcome::Oom),
            count(AttemptOutcome::PeerOom),
            loss / local as f64,
            t0.elapsed().as_secs_f64() * 1e3
        );
        run.plans.push(r.final_plan);
    }
    run.params = mlp.parameters().map_err(|e| format!("{label}: {e}"))?;
    Ok(run)
}

/// A step whose micro-batches fail with a non-OOM error when `fail` is set
/// (`--die-how step-error`).
struct FailingStep<S> {
    inner: S,
    fail: bool,
}

impl<S: Step<Error = Error>> Step for FailingStep<S> {
    type Error = Error;
    type Output = S::Output;
    fn begin(&mut self, plan: &BatchPlan) -> Result<(), Error> {
        self.inner.begin(plan)
    }
    fn micro_batch(&mut self, chunk: &Chunk) -> Result<(), Error> {
        if self.fail {
            return Err(Error::InvalidArgument(
                "failing on purpose inside the step (--die-how step-error)".into(),
            ));
        }
        self.inner.micro_batch(chunk)
    }
    fn abort(&mut self) {
        self.inner.abort()
    }
    fn commit(&mut self) -> S::Output {
        self.inner.commit()
    }
}

/// Makes this rank fail at step `s` the way `how` says (returns only for [`DieHow::Error`]).
fn die(how: DieHow, label: &str, s: usize) -> Result<(), String> {
    println!("[{label}] dying at the start of step {s} ({how:?})");
    match how {
        DieHow::Kill => {
            let pid = std::process::id().to_string();
            let _ = std::process::Command::new("kill")
                .args(["-KILL", &pid])
                .status();
            // `kill` is missing or failed: crash instead.
            std::process::abort()
        }
        DieHow::Abort => std::process::abort(),
        DieHow::Error => Err(format!(
            "{label}: step {s}: failing on purpose (--die-at-step)"
        )),
        DieHow::Panic => panic!("{label}: step {s}: panicking on purpose (--die-at-step)"),
        DieHow::StepError => Ok(()),
    }
}

/// FNV-1a over the bits of `values`: equal hashes for bit-identical vectors.
fn hash_bits(values: impl IntoIterator<Item = u64>) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for v in values {
        for b in v.to_le_bytes() {
            h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

/// ‖a − b‖ / ‖b‖.
fn relative_difference(a: &[f32], b: &[f32]) -> f64 {
    let (mut diff, mut norm) = (0.0f64, 0.0f64);
    for (x, y) in a.iter().zip(b) {
        diff += (f64::from(*x) - f64::from(*y)).powi(2);
        norm += f64::from(*y).powi(2);
    }
    (diff / norm.max(f64::MIN_POSITIVE)).sqrt()
}

/// The threaded form: one process, one thread per GPU.
fn run_threads(o: &Options) -> Result<(), String> {
    const WORLD: usize = THREADS_WORLD;
    if o.batch % WORLD != 0 {
        return Err(format!(
            "--batch must be a multiple of {WORLD} (each rank takes half)"
        ));
    }
    nccl_available().map_err(|e| format!("NCCL is not available: {e}"))?;
    let devices: Vec<Device> = (0..WORLD)
        .map(Device::cuda)
        .collect::<Result<_, _>>()
        .map_err(|e| format!("needs {WORLD} CUDA devices: {e}"))?;
    println!(
        "dims {:?}, global batch {} ({} per rank), {} steps, budget on rank 1: {}",
        o.dims,
        o.batch,
        o.batch / WORLD,
        o.steps,
        o.budget_rank1.map_or("none".to_string(), |b| b.to_string())
    );

    // The reference: one GPU, the whole global batch, no budget.
    let reference = train(o, &devices[0], 0, 1, SingleProcess, None)?;

    let ranks = NcclConsensus::for_devices(&devices).map_err(|e| e.to_string())?;
    if let Some(t) = o.nccl_timeout {
        ranks[0].set_timeout(t).map_err(|e| e.to_string())?;
        ranks[1].set_timeout(t).map_err(|e| e.to_string())?;
    }
    let handles: Vec<_> = devices
        .iter()
        .cloned()
        .zip(ranks)
        .enumerate()
        .map(|(rank, (dev, sync))| {
            let o = o.clone();
            let budget = if rank == 1 { o.budget_rank1 } else { None };
            thread::spawn(move || train(&o, &dev, rank, WORLD, sync, budget))
        })
        .collect();
    // Join every thread before judging, so one rank's failure does not hide the other's.
    let results: Vec<Result<RankRun, String>> = handles
        .into_iter()
        .enumerate()
        .map(|(rank, h)| h.join().map_err(|_| format!("rank {rank} panicked"))?)
        .collect();
    let mut runs = Vec::new();
    let mut errors = Vec::new();
    for r in results {
        match r {
            Ok(run) => runs.push(run),
            Err(e) => errors.push(e),
        }
    }
    if !errors.is_empty() {
        return Err(errors.join("; "));
    }

    let mut failures = Vec::new();
    if runs[0].plans != runs[1].plans {
        failures.push("the ranks ran different plans".to_string());
    }
    if o.budget_rank1.is_some() && runs[1].own_ooms == 0 {
        failures.push("rank 1's budget caused no OOM: lower --budget-rank1".to_string());
    }
    if runs[1].own_ooms > 0 && runs[0].peer_ooms != runs[1].own_ooms {
        failures.push(format!(
            "rank 0 saw {} peer OOMs, rank 1 had {}",
            runs[0].peer_ooms, runs[1].own_ooms
        ));
    }
    let between = relative_difference(&runs[0].params, &runs[1].params);
    let identical = runs[0].params == runs[1].params;
    println!(
        "parameters after {} steps: rank 0 vs rank 1 {} (relative difference {between:.2e})",
        o.steps,
        if identical { "identical" } else { "DIFFER" }
    );
    if !identical {
        failures.push("the ranks' parameters differ".to_string());
    }
    let rel = relative_difference(&runs[0].params, &reference.params);
    println!(
        "data-parallel vs single GPU on the global batch: relative difference {rel:.2e} ({} parameters)",
        reference.params.len()
    );
    if rel.is_nan() || rel > 1e-4 {
        failures.push(format!(
            "data-parallel and single-GPU runs differ by {rel:.2e} > 1e-4"
        ));
    }
    if failures.is_empty() {
        println!("ok: both ranks ran the same plans and ended with the single-GPU parameters");
        Ok(())
    } else {
        Err(failures.join("; "))
    }
}

/// The process form: this process is one rank of a group started by a launcher.
fn run_process(o: &Options) -> Result<(), String> {
    let env = LaunchEnv::from_env().map_err(|e| e.to_string())?;
    let (rank, world) = (env.rank, env.world_size);
    let label = format!("rank {rank}");
    if world < 2 {
        return Err(format!(
            "WORLD_SIZE={world}: the process form needs at least 2 ranks"
        ));
    }
    if o.batch % world != 0 {
        return Err(format!("--batch must be a multiple of WORLD_SIZE={world}"));
    }
    nccl_available().map_err(|e| format!("{label}: NCCL is not available: {e}"))?;
    let dev = Device::cuda(env.device_ordinal).map_err(|e| format!("{label}: {e}"))?;
    let t0 = Instant::now();
    let sync = NcclConsensus::from_launch(&dev, &env).map_err(|e| format!("{label}: {e}"))?;
    if let Some(t) = o.nccl_timeout {
        sync.set_timeout(t).map_err(|e| e.to_string())?;
    }
    println!(
        "[{label}] {} (pid {}): joined a group of {world} via {}:{} ({:?}) in {:.2} s; dims {:?}, \
         global batch {} ({} per rank), {} steps, budget on rank 1: {}, collective timeout {:.0} s",
        dev.name(),
        std::process::id(),
        env.master_addr,
        env.rendezvous_port,
        env.launcher,
        t0.elapsed().as_secs_f64(),
        o.dims,
        o.batch,
        o.batch / world,
        o.steps,
        o.budget_rank1.map_or("none".to_string(), |b| b.to_string()),
        sync.timeout().as_secs_f64()
    );
    let budget = if rank == 1 { o.budget_rank1 } else { None };
    let t_train = Instant::now();
    let run = match train(o, &dev, rank, world, sync.clone(), budget) {
        Ok(run) => run,
        Err(e) => {
            // Exit at once: after an aborted collective, freeing device memory could wait for
            // work that will never finish, and the other ranks learn of the exit from the
            // closed rendezvous link.
            eprintln!(
                "ddp_mlp: {e} (after {:.1} s of training)",
                t_train.elapsed().as_secs_f64()
            );
            std::process::exit(1);
        }
    };

    // Compare the ranks over NCCL: max of h and of !h is (max h, !min h), equal iff every rank
    // has the same h. Then the OOM counts of rank 1 and the peer OOMs of rank 0.
    let params = hash_bits(run.params.iter().map(|p| u64::from(p.to_bits())));
    let plans = hash_bits(
        run.plans
            .iter()
            .flat_map(|p| [p.batch() as u64, p.num_chunks() as u64]),
    );
    let mut v = [
        params,
        !params,
        plans,
        !plans,
        if rank == 1 { run.own_ooms as u64 } else { 0 },
        if rank == 0 { run.peer_ooms as u64 } else { 0 },
    ];
    sync.all_reduce_max(&mut v)
        .map_err(|e| format!("{label}: {e}"))?;
    drop(sync);
    let mut failures = Vec::new();
    let params_same = v[0] == !v[1];
    println!(
        "[{label}] parameters after {} steps: {} across the {world} ranks (hash {params:016x})",
        o.steps,
        if params_same {
            "bit-identical"
        } else {
            "DIFFER"
        }
    );
    if !params_same {
        failures.push("the ranks' parameters differ".to_string());
    }
    if v[2] != !v[3] {
        failures.push("the ranks ran different plans".to_string());
    }
    let (ooms1, peer0) = (v[4], v[5]);
    println!("[{label}] rank 1 had {ooms1} OOMs, rank 0 saw {peer0} peer OOMs");
    if o.budget_rank1.is_some() && ooms1 == 0 {
        failures.push("rank 1's budget caused no OOM: lower --budget-rank1".to_string());
    }
    if peer0 != ooms1 {
        failures.push(format!("rank 0 saw {peer0} peer OOMs, rank 1 had {ooms1}"));
    }
    if rank == 0 {
        // The reference: this GPU, the whole global batch, no budget (after the group is done).
        let reference = train(o, &dev, 0, 1, SingleProcess, None)?;
        let rel = relative_difference(&run.params, &reference.params);
        println!(
            "[{label}] data-parallel vs single GPU on the global batch: relative difference \
             {rel:.2e} ({} parameters)",
            reference.params.len()
        );
        if rel.is_nan() || rel > 1e-4 {
            failures.push(format!(
                "data-parallel and single-GPU runs differ by {rel:.2e} > 1e-4"
            ));
        }
    }
    if failures.is_empty() {
        println!("[{label}] ok: every rank ran the same plans and ended with the same parameters");
        Ok(())
    } else {
        Err(format!("{label}: {}", failures.join("; ")))
    }
}

fn main() {
    let o = match parse_options() {
        Ok(o) => o,
        Err(e) => {
            eprintln!("ddp_mlp: {e}");
            std::process::exit(2);
        }
    };
    let launched = std::env::var_os("RANK").is_some() || std::env::var_os("SLURM_PROCID").is_some();
    let result = if launched && !o.threads {
        run_process(&o)
    } else {
        run_threads(&o)
    };
    if let Err(e) = result {
        eprintln!("ddp_mlp: {e}");
        std::process::exit(1);
    }
}
