//! Every parameter of the GPT-2-shaped model of `examples/burn_gpt` (burn-nn's embedding,
//! transformer, layer-norm, linear and cross-entropy modules) gets a gradient: none of them
//! cuts the graph (as candle-nn's fused layer norm and softmax silently do). A tiny config on
//! burn's ndarray backend under `Autodiff`.

#[allow(dead_code)] // gpt2_small is for the H100 example
#[path = "../examples/burn_gpt/model.rs"]
mod model;

use burn::backend::{Autodiff, NdArray};
use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};
use oomguard::retry::BatchPlan;
use oomguard_burn::{chunk_rows, GradAccumulator};

use model::{Gpt, GptConfig};

type B = Autodiff<NdArray>;

/// Counts float parameters, and those that require a gradient.
#[derive(Default)]
struct Count {
    all: usize,
    trainable: usize,
}

impl<Bk: Backend> ModuleVisitor<Bk> for Count {
    fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<Bk, D>>) {
        self.all += 1;
        self.trainable += usize::from(p.val().is_require_grad());
    }
}

#[test]
fn every_parameter_of_the_gpt_gets_a_gradient() {
    let dev = Default::default();
    let cfg = GptConfig {
        vocab: 50,
        seq: 8,
        width: 16,
        heads: 2,
        layers: 2,
    };
    let model: Gpt<B> = cfg.init(&dev);
    // Seeded synthetic tokens: 4 rows of seq + 1.
    let tokens: Vec<i64> = (0..4 * 9).map(|i| (i * 17 + 3) % 50).collect();
    let tokens = Tensor::<B, 2, Int>::from_data(TensorData::new(tokens, [4, 9]), &dev);

    let mut count = Count::default();
    model.visit(&mut count);
    // 2 embeddings, 2 blocks × (4 attention linears × 2 + 2 ff linears × 2 + 2 norms × 2),
    // final norm × 2, head × 2.
    assert_eq!(count.all, 2 + 2 * (8 + 4 + 4) + 2 + 2);
    assert_eq!(count.trainable, count.all, "every parameter is trainable");

    let plan = BatchPlan::new(4, 2).unwrap();
    let mut acc = GradAccumulator::<B, Gpt<B>>::new();
    for c in plan.chunks() {
        let loss = model.loss(chunk_rows(&tokens, &c).unwrap());
        acc.backward(&model, loss, &c).unwrap();
    }
    assert!(acc.loss() > 0.0);
    // `into_grads` names every trainable parameter without a gradient.
    let grads = acc.into_grads(&model).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(grads.len(), count.all);
}
