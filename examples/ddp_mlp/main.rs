//! The MLP of `examples/train_mlp` trained data-parallel on two GPUs with NCCL, one thread per
//! GPU, surviving an out-of-memory on one rank only.
//!
//! Each rank processes half of every global batch. A memory budget on rank 1 makes it run out of
//! memory; its retry engine and rank 0's agree (an NCCL max all-reduce of their flags after each
//! attempt) so both switch to the same plan, and the gradients are summed once per step, in the
//! commit, after the agreement. The run then checks that the parameters of the two ranks are
//! identical and equal, within 1e-4 relative, to a single-GPU run of the same global batch.
//!
//! ```text
//! cargo run --release --features nccl --example ddp_mlp -- [--steps N] [--batch GLOBAL]
//!   [--dims A,B,..] [--budget-rank1 SIZE|none] [--seed S] [--lr X]
//! ```
//! Needs two CUDA devices and libnccl (as `libnccl.so`); otherwise it says so in one line.

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
use std::time::Instant;

use oomguard::nccl::{nccl_available, NcclConsensus};
use oomguard::retry::{AttemptOutcome, BatchPlan, GradientSync, RetryEngine, SingleProcess};
use oomguard::{ByteSize, Device, Error};

use model::Mlp;
use ops_cuda::CudaOps;
use step::DdpStep;

const WORLD: usize = 2;

#[derive(Clone, Debug)]
struct Options {
    dims: Vec<usize>,
    batch: usize,
    steps: usize,
    seed: u64,
    lr: f32,
    budget_rank1: Option<ByteSize>,
}

fn parse_options() -> Result<Options, String> {
    let mut o = Options {
        dims: vec![1024, 4096, 4096, 10],
        batch: 4096,
        steps: 5,
        seed: 7,
        lr: 0.05,
        budget_rank1: Some(ByteSize::mib(64)),
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
            "-h" | "--help" => {
                return Err(
                    "usage: ddp_mlp [--steps N] [--batch GLOBAL] [--dims A,B,..] \
                            [--budget-rank1 SIZE|none] [--seed S] [--lr X]"
                        .into(),
                )
            }
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    if o.batch == 0 || o.batch % WORLD != 0 {
        return Err(format!(
            "--batch must be a positive multiple of {WORLD} (each rank takes half)"
        ));
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
) -> Result<RankRun, Error> {
    let ops = CudaOps::new(dev)?;
    let mut mlp = Mlp::new(dev, &o.dims, o.seed)?;
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
        let t0 = Instant::now();
        let _budget = budget.map(|b| dev.budget(b));
        let mut step = DdpStep {
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
        let out = engine
            .run_step(dev, local, &mut step)
            .map_err(|e| Error::InvalidArgument(format!("{label}: step {s}: {e}")))?;
        let loss = out.value?;
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
    run.params = mlp.parameters()?;
    Ok(run)
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

fn run(o: &Options) -> Result<(), String> {
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
    let reference = train(o, &devices[0], 0, 1, SingleProcess, None).map_err(|e| e.to_string())?;

    let ranks = NcclConsensus::for_devices(&devices).map_err(|e| e.to_string())?;
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
    let mut runs = Vec::new();
    for (rank, h) in handles.into_iter().enumerate() {
        let r = h
            .join()
            .map_err(|_| format!("rank {rank} panicked"))?
            .map_err(|e| e.to_string())?;
        runs.push(r);
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

fn main() {
    let o = match parse_options() {
        Ok(o) => o,
        Err(e) => {
            eprintln!("ddp_mlp: {e}");
            std::process::exit(2);
        }
    };
    if let Err(e) = run(&o) {
        eprintln!("ddp_mlp: {e}");
        std::process::exit(1);
    }
}
