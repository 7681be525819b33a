//! A GPT-2-shaped decoder in candle-nn: token and position embeddings, pre-norm blocks of causal
//! self-attention and a GELU MLP, a final norm, and an output head tied to the token embedding.
//!
//! Built from differentiable ops only, so that every parameter trains: candle-nn 0.11.1's
//! `LayerNorm::forward` (contiguous input with a bias: `ops::layer_norm`) and
//! `ops::softmax_last_dim` are forward-only (`apply_op*_no_bwd`) and would cut the graph below
//! them. `candle/tests/candle_gpt_model.rs` builds this model small on CPU and fails when any
//! parameter gets no gradient.

use candle_core::{DType, Device, Result, Tensor, D};
use candle_nn::{linear, ops, Embedding, Init, Linear, Module, VarBuilder};

/// A layer norm with a weight and a bias (candle-nn's `layer_norm` parameters, same names and
/// initialisation), applied with the differentiable `ops::layer_norm_slow`.
struct LayerNorm {
    weight: Tensor,
    bias: Tensor,
    eps: f32,
}

impl LayerNorm {
    fn new(size: usize, vb: VarBuilder<'_>) -> Result<Self> {
        let ln = candle_nn::layer_norm(size, 1e-5, vb)?;
        let bias = ln
            .bias()
            .cloned()
            .ok_or_else(|| candle_core::Error::Msg("candle_nn::layer_norm made no bias".into()))?;
        Ok(Self {
            weight: ln.weight().clone(),
            bias,
            eps: ln.eps() as f32,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        ops::layer_norm_slow(x, &self.weight, &self.bias, self.eps)
    }
}

/// The shape of the model: the harness's, shared with `tch_gpt`. Its sizes are `i64`; `dim`
/// turns one into candle's `usize`.
pub type Config = oomguard_harness::GptShape;

/// A size of the shape as a candle dimension.
fn dim(n: i64) -> Result<usize> {
    usize::try_from(n).map_err(|_| candle_core::Error::Msg(format!("model size {n} is negative")))
}

struct Block {
    ln1: LayerNorm,
    qkv: Linear,
    proj: Linear,
    ln2: LayerNorm,
    fc: Linear,
    fc_out: Linear,
    heads: usize,
}

impl Block {
    fn new(c: &Config, vb: VarBuilder<'_>) -> Result<Self> {
        let w = dim(c.width)?;
        Ok(Self {
            ln1: LayerNorm::new(w, vb.pp("ln1"))?,
            qkv: linear(w, 3 * w, vb.pp("qkv"))?,
            proj: linear(w, w, vb.pp("proj"))?,
            ln2: LayerNorm::new(w, vb.pp("ln2"))?,
            fc: linear(w, 4 * w, vb.pp("fc"))?,
            fc_out: linear(4 * w, w, vb.pp("fc_out"))?,
            heads: dim(c.heads)?,
        })
    }

    fn forward(&self, x: &Tensor, mask: &Tensor) -> Result<Tensor> {
        let (b, s, w) = x.dims3()?;
        let hd = w / self.heads;
        let qkv = self.qkv.forward(&self.ln1.forward(x)?)?;
        let split = |i: usize| -> Result<Tensor> {
            qkv.narrow(D::Minus1, i * w, w)?
                .reshape((b, s, self.heads, hd))?
                .transpose(1, 2)?
                .contiguous()
        };
        let (q, k, v) = (split(0)?, split(1)?, split(2)?);
        let att = (q.matmul(&k.t()?)? / (hd as f64).sqrt())?;
        let att = ops::softmax(&att.broadcast_add(mask)?, D::Minus1)?;
        let y = att.matmul(&v)?.transpose(1, 2)?.reshape((b, s, w))?;
        let x = (x + self.proj.forward(&y)?)?;
        let h = self.fc.forward(&self.ln2.forward(&x)?)?.gelu()?;
        x + self.fc_out.forward(&h)?
    }
}

/// The model.
pub struct Gpt {
    wte: Embedding,
    wpe: Embedding,
    blocks: Vec<Block>,
    ln_f: LayerNorm,
    mask: Tensor,
    cfg: Config,
}

impl Gpt {
    pub fn new(cfg: Config, vb: VarBuilder<'_>, dev: &Device) -> Result<Self> {
        cfg.check().map_err(candle_core::Error::Msg)?;
        let blocks = (0..cfg.layers)
            .map(|i| Block::new(&cfg, vb.pp(format!("h{i}"))))
            .collect::<Result<Vec<_>>>()?;
        let (s, width) = (dim(cfg.seq)?, dim(cfg.width)?);
        let mask: Vec<f32> = (0..s * s)
            .map(|i| {
                if i % s > i / s {
                    f32::NEG_INFINITY
                } else {
                    0.0
                }
            })
            .collect();
        // GPT-2's initialisation of the embeddings, N(0, 0.02): the output head is tied to the
        // token embedding, so N(0, 1) would start with logits in the hundreds.
        let emb = |n: i64, name: &str| -> Result<Embedding> {
            let init = Init::Randn {
                mean: 0.,
                stdev: 0.02,
            };
            let w = vb
                .pp(name)
                .get_with_hints((dim(n)?, width), "weight", init)?;
            Ok(Embedding::new(w, width))
        };
        Ok(Self {
            wte: emb(cfg.vocab, "wte")?,
            wpe: emb(cfg.seq, "wpe")?,
            blocks,
            ln_f: LayerNorm::new(width, vb.pp("ln_f"))?,
            mask: Tensor::from_vec(mask, (s, s), dev)?,
            cfg,
        })
    }

    /// Logits `(batch, seq, vocab)` for tokens `(batch, seq)`.
    pub fn forward(&self, tokens: &Tensor) -> Result<Tensor> {
        let (_b, s) = tokens.dims2()?;
        let pos = Tensor::arange(0u32, s as u32, tokens.device())?;
        let mut x = self
            .wte
            .forward(tokens)?
            .broadcast_add(&self.wpe.forward(&pos)?)?;
        let mask = self.mask.narrow(0, 0, s)?.narrow(1, 0, s)?;
        for b in &self.blocks {
            x = b.forward(&x, &mask)?;
        }
        let x = self.ln_f.forward(&x)?;
        x.broadcast_matmul(&self.wte.embeddings().t()?)
    }

    /// Mean next-token cross-entropy over `batch` rows of `(batch, seq + 1)` tokens.
    pub fn loss(&self, rows: &Tensor) -> Result<Tensor> {
        let s = dim(self.cfg.seq)?;
        let input = rows.narrow(1, 0, s)?;
        let target = rows.narrow(1, 1, s)?;
        let logits = self.forward(&input)?;
        let (b, s, v) = logits.dims3()?;
        candle_nn::loss::cross_entropy(&logits.reshape((b * s, v))?, &target.reshape(b * s)?)
    }
}

/// `rows × (seq + 1)` tokens from a seeded xorshift generator (the same seed gives the same
/// batch), as u32 on `dev`.
pub fn synthetic_tokens(seed: u64, rows: usize, cfg: &Config, dev: &Device) -> Result<Tensor> {
    let (len, vocab) = (dim(cfg.seq)? + 1, dim(cfg.vocab)? as u64);
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let data: Vec<u32> = (0..rows * len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % vocab) as u32
        })
        .collect();
    Tensor::from_vec(data, (rows, len), dev)?.to_dtype(DType::U32)
}
