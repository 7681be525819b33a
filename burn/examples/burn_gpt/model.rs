//! A GPT-2-small-shaped decoder built only from burn-nn 0.21's modules: token and position
//! embeddings, a pre-norm `TransformerEncoder` with a causal mask (multi-head attention, GELU
//! feed-forward of 4 × width, layer norms), a final layer norm and a linear head (not tied to
//! the token embedding, unlike GPT-2's). `GptConfig::gpt2_small()` is the shape of
//! `candle_gpt` and the PyTorch anchors: 12 layers, width 768, 12 heads, vocabulary 50,257,
//! sequence 512.
//!
//! Shared by `tests/gpt_grads.rs` (every parameter gets a gradient, on a tiny config) and the
//! H100 example.

use burn::module::Module;
use burn::nn::attention::generate_autoregressive_mask;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::transformer::{
    TransformerEncoder, TransformerEncoderConfig, TransformerEncoderInput,
};
use burn::nn::{Embedding, EmbeddingConfig, LayerNorm, LayerNormConfig, Linear, LinearConfig};
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor};

/// The model's shape.
#[derive(Clone, Copy, Debug)]
pub struct GptConfig {
    /// Vocabulary size.
    pub vocab: usize,
    /// Sequence length (positions).
    pub seq: usize,
    /// Model width.
    pub width: usize,
    /// Attention heads.
    pub heads: usize,
    /// Transformer blocks.
    pub layers: usize,
}

impl GptConfig {
    /// GPT-2 small: 12 layers, width 768, 12 heads, vocabulary 50,257, sequence 512.
    pub fn gpt2_small() -> Self {
        Self {
            vocab: 50_257,
            seq: 512,
            width: 768,
            heads: 12,
            layers: 12,
        }
    }

    /// The model on `device`.
    pub fn init<B: Backend>(&self, device: &B::Device) -> Gpt<B> {
        Gpt {
            tok: EmbeddingConfig::new(self.vocab, self.width).init(device),
            pos: EmbeddingConfig::new(self.seq, self.width).init(device),
            blocks: TransformerEncoderConfig::new(
                self.width,
                4 * self.width,
                self.heads,
                self.layers,
            )
            .with_norm_first(true)
            .with_dropout(0.0)
            .init(device),
            ln_f: LayerNormConfig::new(self.width).init(device),
            head: LinearConfig::new(self.width, self.vocab).init(device),
        }
    }
}

/// The decoder.
#[derive(Module, Debug)]
pub struct Gpt<B: Backend> {
    tok: Embedding<B>,
    pos: Embedding<B>,
    blocks: TransformerEncoder<B>,
    ln_f: LayerNorm<B>,
    head: Linear<B>,
}

impl<B: Backend> Gpt<B> {
    /// Logits `[batch, seq, vocab]` of tokens `[batch, seq]` (causal).
    pub fn forward(&self, tokens: Tensor<B, 2, Int>) -> Tensor<B, 3> {
        let [batch, seq] = tokens.dims();
        let device = tokens.device();
        let positions = Tensor::<B, 1, Int>::arange(0..seq as i64, &device)
            .reshape([1, seq])
            .repeat_dim(0, batch);
        let x = self.tok.forward(tokens) + self.pos.forward(positions);
        let mask = generate_autoregressive_mask::<B>(batch, seq, &device);
        let x = self
            .blocks
            .forward(TransformerEncoderInput::new(x).mask_attn(mask));
        self.head.forward(self.ln_f.forward(x))
    }

    /// Mean next-token cross-entropy of `tokens` `[batch, seq + 1]`: position `i` predicts
    /// token `i + 1`.
    pub fn loss(&self, tokens: Tensor<B, 2, Int>) -> Tensor<B, 1> {
        let [batch, len] = tokens.dims();
        let seq = len - 1;
        let inputs = tokens.clone().narrow(1, 0, seq);
        let targets = tokens.narrow(1, 1, seq).reshape([batch * seq]);
        let logits = self.forward(inputs);
        let vocab = logits.dims()[2];
        CrossEntropyLossConfig::new()
            .init(&logits.device())
            .forward(logits.reshape([batch * seq, vocab]), targets)
    }
}
