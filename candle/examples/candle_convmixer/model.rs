//! ConvMixer-1024/20 from candle-transformers (`models::convmixer::c1024_20`: patch 14, kernel 9,
//! depthwise convolutions, eval-mode batch norm), written by candle's authors, not here: random
//! initialisation and synthetic images, as no weights can be downloaded. (candle-transformers'
//! ResNet cannot train: candle has no backward for its 3 × 3, stride-2 max pooling; its VGG runs
//! one image at a time.) Shared by the H100 example and the CPU
//! check (`candle/tests/models.rs`).

use candle_core::{DType, Device, Module, Result, Tensor, Var, D};
use candle_nn::{VarBuilder, VarMap};

/// Image size and classes (the network is ConvMixer-1024/20 in both).
#[derive(Clone, Copy, Debug)]
pub struct Config {
    /// Square image side in pixels.
    pub image: usize,
    /// Number of classes.
    pub classes: usize,
}

impl Config {
    /// ImageNet's shape: 224 × 224, 1000 classes.
    #[allow(dead_code)] // used by the H100 example only
    pub fn imagenet() -> Self {
        Self {
            image: 224,
            classes: 1000,
        }
    }
    /// The same network on 14 × 14 images (one patch) and 10 classes, for CPU checks.
    #[allow(dead_code)] // used by the CPU test only
    pub fn tiny() -> Self {
        Self {
            image: 14,
            classes: 10,
        }
    }
}

/// The network and its configuration.
pub struct ConvMixer<'a> {
    net: candle_nn::Func<'a>,
    /// The configuration it was made with.
    pub cfg: Config,
}

impl<'a> ConvMixer<'a> {
    /// candle-transformers' `c1024_20` with its weights from `vb`.
    pub fn new(cfg: Config, vb: VarBuilder<'a>) -> Result<Self> {
        let net = candle_transformers::models::convmixer::c1024_20(cfg.classes, vb)?;
        Ok(Self { net, cfg })
    }

    /// Each row's cross-entropy (no mean: eval-mode batch norm makes rows independent).
    pub fn per_row_loss(&self, x: &Tensor, y: &Tensor) -> Result<Tensor> {
        let logits = self.net.forward(x)?;
        let logp = candle_nn::ops::log_softmax(&logits, D::Minus1)?;
        logp.gather(&y.unsqueeze(1)?, 1)?.squeeze(1)?.neg()
    }

    /// The batch's mean cross-entropy.
    pub fn loss(&self, x: &Tensor, y: &Tensor) -> Result<Tensor> {
        self.per_row_loss(x, y)?.mean_all()
    }
}

/// The variables that are trained: every one but batch norm's running statistics (buffers,
/// read detached in eval mode), sorted by name.
pub fn trainable(varmap: &VarMap) -> Vec<(String, Var)> {
    let data = varmap.data().lock().unwrap_or_else(|e| e.into_inner());
    let mut v: Vec<(String, Var)> = data
        .iter()
        .filter(|(n, _)| !n.ends_with("running_mean") && !n.ends_with("running_var"))
        .map(|(n, v)| (n.clone(), v.clone()))
        .collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

/// `rows` synthetic images (values in [-1, 1)) and labels from `seed`, the same on any device.
pub fn synthetic_batch(
    seed: u64,
    rows: usize,
    cfg: &Config,
    dev: &Device,
) -> Result<(Tensor, Tensor)> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut next = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    };
    let n = rows * 3 * cfg.image * cfg.image;
    let x: Vec<f32> = (0..n)
        .map(|_| (next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0)
        .collect();
    let y: Vec<u32> = (0..rows)
        .map(|_| (next() % cfg.classes as u64) as u32)
        .collect();
    let x = Tensor::from_vec(x, (rows, 3, cfg.image, cfg.image), dev)?;
    let y = Tensor::from_vec(y, rows, dev)?.to_dtype(DType::U32)?;
    Ok((x, y))
}
