//! ConvMixer-1024/20 from candle-transformers trained under oomguard on a CUDA device, with
//! candle's tensors on the driver's pool or on oomguard's allocator (issue 24, item 6).
//!
//! ```text
//! candle_convmixer [frag|max|oom|all] [--allocator pool|oomguard] [--batch ROWS] [--steps N]
//!                  [--big ROWS] [--device ORDINAL]
//! ```
//! - `frag`: `--steps` (20) plain AdamW steps at `--batch` rows: peak reserved / peak used, OOMs;
//! - `max`: the largest batch a single step runs (bisection, cache emptied around each run);
//! - `oom`: `train_step` at `--big` rows (default twice the maximum found): a real OOM survived
//!   by exact accumulation, then 2 more steps from the remembered plan.
//!
//! 224 × 224 synthetic images, 1000 classes, f32 with TF32 matmuls. Every figure is printed on a
//! line starting with `RESULT`.

#[path = "../common/measure.rs"]
mod measure;
mod model;

use std::time::Instant;

use candle_core::Device;
use candle_nn::{AdamW, Optimizer, ParamsAdamW, VarBuilder, VarMap};
use oomguard::RetryEngine;
use oomguard_candle::train_step;

use measure::{flag, Allocator, Res};
use model::{synthetic_batch, trainable, Config, ConvMixer};

fn main() -> Res<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let phase = measure::phase(&args, &["frag", "max", "oom"])?;
    let allocator = Allocator::from_args(&args)?;
    let dev = Device::new_cuda(flag(&args, "--device")?.unwrap_or(0))?;
    let source = allocator.source(&dev)?;
    candle_core::cuda::set_gemm_reduced_precision_f32(true);
    let cfg = Config::imagenet();
    let varmap = VarMap::new();
    let model = ConvMixer::new(
        cfg,
        VarBuilder::from_varmap(&varmap, candle_core::DType::F32, &dev),
    )?;
    let vars: Vec<_> = trainable(&varmap).into_iter().map(|(_, v)| v).collect();
    let n: usize = vars.iter().map(|v| v.elem_count()).sum();
    oomguard_harness::say!(
        "model: ConvMixer-1024/20, {n} trained parameters in {} tensors; memory: {}",
        vars.len(),
        source.info()
    );
    let adamw = || {
        AdamW::new(
            vars.clone(),
            ParamsAdamW {
                lr: 1e-3,
                ..Default::default()
            },
        )
    };
    let mut opt = adamw()?;
    let mut plain_step = |seed: u64, rows: usize| -> candle_core::Result<()> {
        let (x, y) = synthetic_batch(seed, rows, &model.cfg, &dev)?;
        let loss = model.loss(&x, &y)?;
        opt.backward_step(&loss)?;
        dev.synchronize()
    };
    // Optimizer state exists before any measurement, as in a run that is already training.
    plain_step(0, 1)?;
    let mut max = None;
    if phase == "all" || phase == "max" {
        max = Some(measure::max_batch(&source, 8, |rows| {
            plain_step(rows as u64, rows)
        })?);
    }
    if phase == "all" || phase == "frag" {
        let batch = flag(&args, "--batch")?
            .or(max.map(|m| m * 9 / 10))
            .ok_or("frag needs --batch")?;
        let steps = flag(&args, "--steps")?.unwrap_or(20);
        measure::fragmentation(&format!("batch {batch}"), &source, steps, |s| {
            plain_step(100 + s as u64, batch)
        })?;
    }
    if phase == "all" || phase == "oom" {
        let big = flag(&args, "--big")?
            .or(max.map(|m| 2 * m))
            .ok_or("oom needs --big")?;
        let engine = RetryEngine::new();
        let mut opt = adamw()?;
        for step in 0..3u64 {
            let (x, y) = synthetic_batch(1000 + step, big, &model.cfg, &dev)?;
            let t0 = Instant::now();
            let done = train_step(&engine, &source, &[&x, &y], &vars, &mut opt, |_, rows| {
                model.loss(&rows[0], &rows[1])
            })?;
            dev.synchronize()?;
            let r = &done.report;
            oomguard_harness::say!(
                "RESULT oom: step {step} batch {big}: {} retries, plan {} x {} (from memory: {}), rows {}, loss {:.4}, {:.1} s",
                r.retries(),
                r.final_plan.chunks().len(),
                r.final_plan.micro_batch(),
                r.from_memory,
                done.rows,
                done.loss,
                t0.elapsed().as_secs_f64()
            );
        }
    }
    oomguard_harness::say!("{}", source.memory_summary());
    Ok(())
}
