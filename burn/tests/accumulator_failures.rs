//! A chunk that fails after its gradients were added, through burn's `GradAccumulator` (from a
//! hostile pass).

use burn::backend::{Autodiff, NdArray};
use burn::module::{Module, Param};
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use oomguard::retry::{BatchPlan, Chunk};
use oomguard_burn::{chunk_rows, GradAccumulator};

type B = Autodiff<NdArray>;

#[derive(Module, Debug)]
struct Lin<B: Backend> {
    w: Param<Tensor<B, 2>>,
}

fn lin() -> Lin<B> {
    let d = Default::default();
    let w = TensorData::new(vec![0.1f32, 0.2, 0.3, 0.4], [4, 1]);
    Lin {
        w: Param::from_tensor(Tensor::from_data(w, &d)),
    }
}

fn data(n: usize) -> (Tensor<B, 2>, Tensor<B, 2>) {
    let d = Default::default();
    let x: Vec<f32> = (0..n * 4)
        .map(|i| ((i * 37 % 101) as f32) / 50.0 - 1.0)
        .collect();
    let x = Tensor::<B, 2>::from_data(TensorData::new(x, [n, 4]), &d);
    let w = Tensor::<B, 2>::from_data(TensorData::new(vec![1f32, -2., 3., 0.5], [4, 1]), &d);
    let y = x.clone().matmul(w).detach();
    (x, y)
}

fn mse(m: &Lin<B>, x: Tensor<B, 2>, y: Tensor<B, 2>) -> Tensor<B, 1> {
    (x.matmul(m.w.val()) - y).powi_scalar(2).mean()
}

/// A NaN chunk was refused after its gradients were added; the same accumulator then took the
/// chunk again and returned `Ok` with NaN gradients. It refuses every later call now.
#[test]
fn an_accumulator_refuses_everything_after_a_chunk_failed_past_its_gradients() {
    let (x, y) = data(8);
    let m = lin();
    let plan = BatchPlan::new(8, 2).unwrap();
    let (c0, c1) = (plan.chunk(0).unwrap(), plan.chunk(1).unwrap());
    let mut acc = GradAccumulator::<B, Lin<B>>::new();
    let part = |c: &Chunk| mse(&m, chunk_rows(&x, c).unwrap(), chunk_rows(&y, c).unwrap());
    let e = acc
        .backward(&m, part(&c0).mul_scalar(f32::NAN), &c0)
        .unwrap_err();
    assert!(e.to_string().contains("NaN"), "{e}");
    let again = acc.backward(&m, part(&c0), &c0).unwrap_err().to_string();
    assert!(again.contains("start a new `GradAccumulator`"), "{again}");
    assert!(acc.backward(&m, part(&c1), &c1).is_err());
    assert!(acc.into_grads(&m).is_err());
}
