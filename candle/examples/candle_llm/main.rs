//! Inference with a decoder LLM from candle-transformers (Mistral's architecture, ~1.2 B
//! parameters, random bf16 weights) on a CUDA device, with candle's tensors on the driver's pool or
//! on oomguard's allocator (issue 24, item 7).
//!
//! ```text
//! candle_llm [serve|max|all] [--allocator pool|oomguard] [--requests N] [--passes N]
//!            [--prompt TOKENS] [--device ORDINAL]
//! ```
//! - `serve`: `--requests` (300) requests whose batch size (1-16), prompt length (32-1024 tokens)
//!   and generated length (16-64 tokens) come from a seeded distribution; each is a prefill and
//!   greedy generation with the model's KV cache. Peak reserved / peak used over the whole run,
//!   and generated tokens per second. With `--passes N` (1) the same requests run N times, the
//!   cache kept between passes: a `RESULT pass` line each (tokens/s, and under oomguard the
//!   allocator's driver calls in the pass), so that a pass that grows the cache can be told from
//!   one that reuses it;
//! - `max`: the largest batch one request serves (prompt `--prompt`, default 1024 tokens, 16
//!   generated), by bisection.
//!
//! Every figure is printed on a line starting with `RESULT`.

#[path = "../common/measure.rs"]
mod measure;

use std::time::Instant;

use candle_core::{DType, Device, IndexOp, Tensor, D};
use candle_nn::{VarBuilder, VarMap};
use candle_transformers::models::mistral::{Config, Model};

use measure::{flag, Allocator, Res};

/// A ~1.2 B-parameter Mistral-architecture decoder (grouped-query attention, SiLU MLP).
fn config() -> Config {
    Config {
        vocab_size: 32000,
        hidden_size: 2048,
        intermediate_size: 5632,
        num_hidden_layers: 16,
        num_attention_heads: 16,
        head_dim: None,
        num_key_value_heads: 4,
        hidden_act: candle_nn::Activation::Silu,
        max_position_embeddings: 4096,
        rms_norm_eps: 1e-5,
        rope_theta: 10000.,
        sliding_window: None,
        use_flash_attn: false,
    }
}

/// A small deterministic generator for the request stream and the prompts.
#[derive(Clone)]
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    /// Uniform in `lo..=hi`.
    fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + (self.next() % (hi - lo + 1) as u64) as usize
    }
    /// Log-uniform in `lo..=hi` (short prompts more often than long ones).
    fn log_range(&mut self, lo: usize, hi: usize) -> usize {
        let u = (self.next() >> 11) as f64 / (1u64 << 53) as f64;
        ((lo as f64).ln() + u * ((hi as f64).ln() - (lo as f64).ln()))
            .exp()
            .round() as usize
    }
}

/// One request: a prefill of `batch` prompts of `prompt` tokens, then `gen` greedy tokens.
fn request(
    model: &mut Model,
    dev: &Device,
    rng: &mut Rng,
    batch: usize,
    prompt: usize,
    gen: usize,
) -> candle_core::Result<usize> {
    model.clear_kv_cache();
    let r = generate(model, dev, rng, batch, prompt, gen);
    model.clear_kv_cache(); // on an error too: the cache would keep the failed request's memory
    r
}

fn generate(
    model: &mut Model,
    dev: &Device,
    rng: &mut Rng,
    batch: usize,
    prompt: usize,
    gen: usize,
) -> candle_core::Result<usize> {
    let ids: Vec<u32> = (0..batch * prompt)
        .map(|_| (rng.next() % 32000) as u32)
        .collect();
    let mut input = Tensor::from_vec(ids, (batch, prompt), dev)?;
    let mut offset = 0;
    for _ in 0..gen {
        let logits = model.forward(&input, offset)?; // (batch, 1, vocab): the last position
        offset += input.dim(1)?;
        input = logits
            .i((.., 0, ..))?
            .argmax_keepdim(D::Minus1)?
            .to_dtype(DType::U32)?;
    }
    let _ = input.to_vec2::<u32>()?; // the answer reaches the host
    Ok(batch * gen)
}

/// The device oomguard's hook serves `dev` with, when it does.
#[cfg(feature = "allocator-hook")]
fn installed(dev: &Device) -> Option<oomguard::Device> {
    oomguard_candle::alloc_hook::installed_device(dev)
}

#[cfg(not(feature = "allocator-hook"))]
fn installed(_: &Device) -> Option<oomguard::Device> {
    None
}

/// The allocator's driver calls so far: device allocations, frees, maps, unmaps.
fn driver_calls(d: &oomguard::Device) -> [u64; 4] {
    let s = d.stats();
    [
        s.num_device_alloc,
        s.num_device_free,
        s.num_map,
        s.num_unmap,
    ]
}

fn main() -> Res<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let phase = measure::phase(&args, &["serve", "max"])?;
    let allocator = Allocator::from_args(&args)?;
    let dev = Device::new_cuda(flag(&args, "--device")?.unwrap_or(0))?;
    let source = allocator.source(&dev)?;
    dev.set_seed(7)?;
    let varmap = VarMap::new();
    let mut model = Model::new(
        &config(),
        VarBuilder::from_varmap(&varmap, DType::BF16, &dev),
    )?;
    let n: usize = varmap.all_vars().iter().map(|v| v.elem_count()).sum();
    oomguard_harness::say!(
        "model: Mistral architecture, {n} parameters (bf16, random); memory: {}",
        source.info()
    );
    let mut rng = Rng(0x5eed);
    request(&mut model, &dev, &mut rng, 1, 16, 2)?; // kernels and cuBLAS warmed up
    if phase == "all" || phase == "serve" {
        let requests = flag(&args, "--requests")?.unwrap_or(300);
        let passes = flag(&args, "--passes")?.unwrap_or(1).max(1);
        let hook = installed(&dev);
        source.empty_cache()?;
        source.reset_peak()?;
        let (mut tokens, mut prompt_tokens, mut ooms) = (0, 0, 0);
        let stream = rng.clone();
        let t0 = Instant::now();
        for pass in 1..=passes {
            rng = stream.clone(); // every pass serves the same requests
            let (t_pass, tokens_before) = (Instant::now(), tokens);
            let calls_before = hook.as_ref().map(driver_calls);
            for _ in 0..requests {
                let batch = rng.log_range(1, 16);
                let prompt = rng.log_range(32, 1024);
                let gen = rng.range(16, 64);
                match request(&mut model, &dev, &mut rng, batch, prompt, gen) {
                    Ok(t) => {
                        tokens += t;
                        prompt_tokens += batch * prompt;
                    }
                    Err(e) if measure::is_oom(&e) => ooms += 1,
                    Err(e) => return Err(e.into()),
                }
            }
            let secs = t_pass.elapsed().as_secs_f64();
            let calls = match (&hook, calls_before) {
                (Some(d), Some(b)) => {
                    let a = driver_calls(d);
                    format!(
                        "; device allocs {}, frees {}, maps {}, unmaps {}",
                        a[0] - b[0],
                        a[1] - b[1],
                        a[2] - b[2],
                        a[3] - b[3]
                    )
                }
                _ => String::new(),
            };
            oomguard_harness::say!(
                "RESULT pass {pass}/{passes}: {} tokens in {secs:.1} s = {:.0} tokens/s{calls}",
                tokens - tokens_before,
                (tokens - tokens_before) as f64 / secs
            );
        }
        let secs = t0.elapsed().as_secs_f64();
        let u = source.usage()?;
        oomguard_harness::say!(
            "RESULT serve: {}, {requests} requests: {tokens} tokens generated ({prompt_tokens} prompt \
             tokens) in {secs:.1} s = {:.0} tokens/s; peak reserved {} / peak used {} = {:.4}; {ooms} OOM",
            source.info().kind,
            tokens as f64 / secs,
            u.reserved_peak,
            u.used_peak,
            u.reserved_peak as f64 / u.used_peak.max(1) as f64
        );
        let used = measure::device_used()?;
        oomguard_harness::say!(
            "RESULT unseen: device used {used} B, {} reserved {} B: {} B outside it",
            source.info().kind,
            u.reserved,
            used as i64 - u.reserved as i64
        );
    }
    if phase == "all" || phase == "max" {
        let prompt = flag(&args, "--prompt")?.unwrap_or(1024);
        measure::max_batch(&source, 16, |batch| {
            request(&mut model, &dev, &mut rng, batch, prompt, 16).map(|_| ())
        })?;
    }
    oomguard_harness::say!("{}", source.memory_summary());
    Ok(())
}
