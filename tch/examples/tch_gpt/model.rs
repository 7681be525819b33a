//! A GPT-2-shaped decoder in tch: token and position embeddings, pre-LayerNorm blocks of causal
//! self-attention and a GELU MLP (4 × width), a final LayerNorm, and an output head **tied** to
//! the token embedding (GPT-2's own choice: the head is `wte`'s transpose, so `wte` receives the
//! gradient of both its uses).
//!
//! Written with libtorch's differentiable ops only (`matmul`, `layer_norm`, `softmax`,
//! `masked_fill`, `gelu`, `embedding`, `cross_entropy_loss`), never a fused attention kernel,
//! so autograd covers every parameter; `tests/tch_gpt_model.rs` fails when one gets no
//! gradient. Every op is the fallible `f_*` form: an out-of-memory anywhere in the forward is a
//! `TchError`, not a panic.
//!
//! Shared by `examples/tch_gpt` and `tests/tch_gpt_model.rs` (through `#[path]`).

use tch::nn::{self, Init};
use tch::{Device, Kind, Reduction, TchError, Tensor};

/// The model's shape: the harness's, shared with `candle_gpt` (`i64` sizes, tch's own type).
pub type Config = oomguard_harness::GptShape;

/// A LayerNorm's weight (ones) and bias (zeros).
struct LayerNorm {
    weight: Tensor,
    bias: Tensor,
}

impl LayerNorm {
    fn new(p: nn::Path<'_>, width: i64) -> Result<Self, TchError> {
        Ok(Self {
            weight: p.f_var("weight", &[width], Init::Const(1.0))?,
            bias: p.f_var("bias", &[width], Init::Const(0.0))?,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor, TchError> {
        let width = self.weight.size()[0];
        x.f_layer_norm([width], Some(&self.weight), Some(&self.bias), 1e-5, true)
    }
}

/// `x · weightᵀ + bias`, weight `(out, in)` as in `torch.nn.Linear`.
struct Linear {
    weight: Tensor,
    bias: Tensor,
}

impl Linear {
    /// GPT-2's initialisation: weight N(0, `stdev`), bias zero.
    fn new(p: nn::Path<'_>, input: i64, output: i64, stdev: f64) -> Result<Self, TchError> {
        Ok(Self {
            weight: p.f_var("weight", &[output, input], Init::Randn { mean: 0., stdev })?,
            bias: p.f_var("bias", &[output], Init::Const(0.0))?,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor, TchError> {
        x.f_matmul(&self.weight.f_tr()?)?.f_add(&self.bias)
    }
}

struct Block {
    ln1: LayerNorm,
    qkv: Linear,
    proj: Linear,
    ln2: LayerNorm,
    fc: Linear,
    fc_out: Linear,
    heads: i64,
}

impl Block {
    fn new(p: nn::Path<'_>, c: &Config) -> Result<Self, TchError> {
        let w = c.width;
        // GPT-2 scales the init of the projections into the residual stream by 1/sqrt(2 L).
        let residual = 0.02 / ((2 * c.layers) as f64).sqrt();
        Ok(Self {
            ln1: LayerNorm::new(&p / "ln1", w)?,
            qkv: Linear::new(&p / "qkv", w, 3 * w, 0.02)?,
            proj: Linear::new(&p / "proj", w, w, residual)?,
            ln2: LayerNorm::new(&p / "ln2", w)?,
            fc: Linear::new(&p / "fc", w, 4 * w, 0.02)?,
            fc_out: Linear::new(&p / "fc_out", 4 * w, w, residual)?,
            heads: c.heads,
        })
    }

    /// `x`: `(batch, seq, width)`; `causal`: `(seq, seq)` bool, true above the diagonal.
    fn forward(&self, x: &Tensor, causal: &Tensor) -> Result<Tensor, TchError> {
        let (b, s, w) = x.size3()?;
        let hd = w / self.heads;
        let qkv = self.qkv.forward(&self.ln1.forward(x)?)?;
        // (batch, heads, seq, head width) each.
        let split = |i: i64| -> Result<Tensor, TchError> {
            qkv.f_narrow(-1, i * w, w)?
                .f_view([b, s, self.heads, hd])?
                .f_transpose(1, 2)
        };
        let (q, k, v) = (split(0)?, split(1)?, split(2)?);
        let scores = q
            .f_matmul(&k.f_transpose(-2, -1)?)?
            .f_mul_scalar(1.0 / (hd as f64).sqrt())?
            .f_masked_fill(causal, f64::NEG_INFINITY)?;
        let att = scores.f_softmax(-1, Kind::Float)?;
        let y = att
            .f_matmul(&v)?
            .f_transpose(1, 2)?
            .f_contiguous()?
            .f_view([b, s, w])?;
        let x = x.f_add(&self.proj.forward(&y)?)?;
        let h = self.fc.forward(&self.ln2.forward(&x)?)?.f_gelu("tanh")?;
        x.f_add(&self.fc_out.forward(&h)?)
    }
}

/// The decoder; its parameters live in the `VarStore` it was built in.
pub struct Gpt {
    wte: Tensor,
    wpe: Tensor,
    blocks: Vec<Block>,
    ln_f: LayerNorm,
    /// `(seq, seq)` bool, true above the diagonal (the future a position must not see).
    causal: Tensor,
    cfg: Config,
}

impl Gpt {
    /// The model's parameters, randomly initialised (GPT-2's scheme) in `vs`.
    pub fn new(vs: &nn::VarStore, cfg: Config) -> Result<Self, TchError> {
        cfg.check().map_err(TchError::Shape)?;
        let root = vs.root();
        let emb = Init::Randn {
            mean: 0.,
            stdev: 0.02,
        };
        let wte = root.f_var("wte", &[cfg.vocab, cfg.width], emb)?;
        let wpe = root.f_var("wpe", &[cfg.seq, cfg.width], emb)?;
        let blocks = (0..cfg.layers)
            .map(|i| Block::new(&root / format!("h{i}"), &cfg))
            .collect::<Result<Vec<_>, _>>()?;
        let ln_f = LayerNorm::new(&root / "ln_f", cfg.width)?;
        let causal = Tensor::f_ones([cfg.seq, cfg.seq], (Kind::Bool, vs.device()))?.f_triu(1)?;
        Ok(Self {
            wte,
            wpe,
            blocks,
            ln_f,
            causal,
            cfg,
        })
    }

    /// Logits `(batch, seq, vocab)` of tokens `(batch, seq)` (int64, `seq` at most the
    /// context).
    pub fn forward(&self, tokens: &Tensor) -> Result<Tensor, TchError> {
        let (_, s) = tokens.size2()?;
        if s > self.cfg.seq {
            return Err(TchError::Shape(format!(
                "{s} tokens per row, the model's context is {}",
                self.cfg.seq
            )));
        }
        let tok = Tensor::f_embedding(&self.wte, tokens, -1, false, false)?;
        let pos = self.wpe.f_narrow(0, 0, s)?;
        let mut x = tok.f_add(&pos)?;
        let causal = self.causal.f_narrow(0, 0, s)?.f_narrow(1, 0, s)?;
        for b in &self.blocks {
            x = b.forward(&x, &causal)?;
        }
        // The tied head: logits = ln_f(x) · wteᵀ.
        self.ln_f.forward(&x)?.f_matmul(&self.wte.f_tr()?)
    }

    /// Mean next-token cross-entropy of `rows` `(batch, seq + 1)`: position `i` predicts token
    /// `i + 1`. Every row has `seq` targets, so this is the mean over rows of each row's mean:
    /// a micro-batch's loss weighted by its share of the rows gives the batch's.
    pub fn loss(&self, rows: &Tensor) -> Result<Tensor, TchError> {
        let (_, len) = rows.size2()?;
        if len < 2 {
            return Err(TchError::Shape(format!(
                "rows of {len} tokens: next-token loss needs at least 2"
            )));
        }
        let input = rows.f_narrow(1, 0, len - 1)?;
        let target = rows.f_narrow(1, 1, len - 1)?.f_reshape([-1])?;
        let logits = self.forward(&input)?;
        logits
            .f_view([-1, self.cfg.vocab])?
            .f_cross_entropy_loss::<Tensor>(&target, None, Reduction::Mean, -100, 0.0)
    }
}

/// `rows × (seq + 1)` int64 tokens below `cfg.vocab` from a seeded xorshift64* generator (the
/// same seed gives the same batch on every device), on `dev`.
pub fn synthetic_tokens(
    seed: u64,
    rows: i64,
    cfg: &Config,
    dev: Device,
) -> Result<Tensor, TchError> {
    let len = cfg.seq + 1;
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let data: Vec<i64> = (0..rows * len)
        .map(|_| {
            x ^= x >> 12;
            x ^= x << 25;
            x ^= x >> 27;
            ((x.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 33) % cfg.vocab as u64) as i64
        })
        .collect();
    Tensor::f_from_slice(&data)?
        .f_view([rows, len])?
        .f_to_device(dev)
}
