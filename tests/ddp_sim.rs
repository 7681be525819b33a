//! Data parallelism with a budget on one rank, on the simulated device with the example's own
//! model, host math and step (`examples/ddp_mlp/step.rs`): two ranks on threads (a `LocalGroup`)
//! agree on every step's plan although only one of them runs out of memory, end with identical
//! parameters, and match one rank training on the global batch.

#[allow(dead_code)]
#[path = "../examples/train_mlp/model.rs"]
mod model;
#[allow(dead_code)]
#[path = "../examples/train_mlp/ops.rs"]
mod ops;
#[path = "../examples/ddp_mlp/step.rs"]
mod step;

use std::thread;

use oomguard::retry::{
    AttemptOutcome, BatchPlan, Consensus, GradientSync, LocalGroup, RetryEngine, SingleProcess,
};
use oomguard::{ByteSize, Device};

use model::Mlp;
use ops::HostOps;
use step::DdpStep;

const DIMS: [usize; 4] = [16, 32, 32, 10];
const GLOBAL: usize = 48;
const STEPS: usize = 3;

/// What one rank saw: its plan and attempt outcomes per step, and its final parameters.
struct RankRun {
    plans: Vec<BatchPlan>,
    outcomes: Vec<Vec<AttemptOutcome>>,
    params: Vec<f32>,
}

/// Trains `STEPS` steps as rank `rank` of `world` (rows `rank * local ..` of each global batch),
/// under a memory budget when one is given.
fn train(
    rank: usize,
    world: usize,
    sync: impl GradientSync + Clone + 'static,
    budget: Option<ByteSize>,
) -> RankRun {
    let dev = Device::sim(ByteSize::gib(1));
    let mut mlp = Mlp::new(&dev, &DIMS, 7).unwrap();
    let engine = RetryEngine::new().with_consensus(sync.clone());
    let local = GLOBAL / world;
    let mut run = RankRun {
        plans: vec![],
        outcomes: vec![],
        params: vec![],
    };
    for s in 0..STEPS {
        let _budget = budget.map(|b| dev.thread_budget(b));
        let mut step = DdpStep {
            dev: &dev,
            ops: &HostOps,
            mlp: &mut mlp,
            sync: &sync,
            global: GLOBAL,
            first_row: s * GLOBAL + rank * local,
            seed: 7,
            lr: 0.5,
            loss: 0.0,
        };
        let out = engine.run_step(&dev, local, &mut step).unwrap();
        assert!(out.value.unwrap().is_finite());
        run.plans.push(out.report.final_plan);
        run.outcomes
            .push(out.report.attempts.iter().map(|a| a.outcome).collect());
    }
    run.params = mlp.parameters().unwrap();
    run
}

#[test]
fn two_ranks_with_a_budget_on_one_agree_and_match_one_rank_on_the_global_batch() {
    let reference = train(0, 1, SingleProcess, None);
    assert!(reference.plans.iter().all(|p| p.micro_batch() == GLOBAL));

    let handles: Vec<_> = LocalGroup::new(2)
        .into_iter()
        .map(|g| {
            let rank = g.rank();
            // rank 1 may hold 8 KiB per step: too little for its 24 rows at once
            let budget = (rank == 1).then(|| ByteSize::kib(8));
            thread::spawn(move || train(rank, 2, g, budget))
        })
        .collect();
    let runs: Vec<RankRun> = handles.into_iter().map(|h| h.join().unwrap()).collect();

    // The same plan on both ranks at every step, smaller than the local batch: rank 1 ran out
    // of memory, rank 0 followed.
    assert_eq!(runs[0].plans, runs[1].plans);
    assert!(
        runs[1].plans[0].micro_batch() < GLOBAL / 2,
        "{}",
        runs[1].plans[0]
    );
    assert!(runs[1].outcomes[0].contains(&AttemptOutcome::Oom));
    assert!(runs[0].outcomes[0].contains(&AttemptOutcome::PeerOom));
    assert!(!runs[0].outcomes[0].contains(&AttemptOutcome::Oom));
    for (s, (a, b)) in runs[0].outcomes.iter().zip(&runs[1].outcomes).enumerate() {
        assert_eq!(a.len(), b.len(), "step {s}: as many attempts on both ranks");
    }

    // Identical parameters on both ranks, equal to the single-rank run up to summation order.
    assert_eq!(runs[0].params, runs[1].params);
    let (mut diff, mut norm) = (0.0f64, 0.0f64);
    for (a, b) in runs[0].params.iter().zip(&reference.params) {
        diff += (f64::from(*a) - f64::from(*b)).powi(2);
        norm += f64::from(*b).powi(2);
    }
    let rel = (diff / norm).sqrt();
    assert!(rel < 1e-5, "relative difference {rel:.2e}");
    assert_ne!(
        runs[0].params,
        Mlp::new(&Device::sim(ByteSize::mib(64)), &DIMS, 7)
            .unwrap()
            .parameters()
            .unwrap(),
        "the parameters were trained"
    );
}
