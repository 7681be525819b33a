//! `oomguard_burn::find_max_batch` on a burn step (ndarray + `Autodiff`): the step's memory is
//! a simulated card charged per row, and a cubecl out-of-memory *panic* past some rows is a
//! failed run of the search, not a crash.

use burn::backend::{Autodiff, NdArray};
use burn::nn::{Linear, LinearConfig};
use burn::tensor::{Distribution, Tensor};
use oomguard::retry::FinderOptions;
use oomguard::ByteSize;
use oomguard_burn::{find_max_batch, Error};

type B = Autodiff<NdArray>;

/// A forward and backward pass over `rows` random rows, read back (as a real step would).
fn burn_step(model: &Linear<B>, rows: usize) -> Result<f32, Error> {
    let dev = Default::default();
    let x = Tensor::<B, 2>::random([rows, 4], Distribution::Default, &dev);
    let loss = model.forward(x).powi_scalar(2).mean();
    let _grads = loss.backward();
    Ok(loss.try_into_data()?.iter::<f32>().next().unwrap_or(0.0))
}

#[test]
fn finds_the_batch_a_burn_step_fits_through_oom_panics() {
    let model: Linear<B> = LinearConfig::new(4, 1).init(&Default::default());
    let sim = oomguard::Device::sim(ByteSize::mib(256));
    // 16 MiB of workspace plus 1 MiB of activations per row: about 240 rows fit.
    let report = find_max_batch(&sim, FinderOptions::default(), |rows| {
        let _ws = sim.alloc::<u8>(16 << 20)?;
        let _acts = sim.alloc::<u8>(rows << 20)?;
        burn_step(&model, rows)
    })
    .unwrap();
    assert!((228..=240).contains(&report.max_batch), "{report}");
    assert!(report.runs() <= 4, "{report}");

    // A cubecl out-of-memory panic past 100 rows is a failed run, not a crash. (In the same
    // test: the count of out-of-memory panics is process-wide, so the two searches must not
    // run at once.)
    let report = find_max_batch(&sim, FinderOptions::default(), |rows| {
        let _acts = sim.alloc::<u8>(rows << 20)?;
        if rows > 100 {
            // What cubecl raises when a reservation fails.
            panic!(
                "called `Result::unwrap()` on an `Err` value: can't allocate buffer of size: {}\n",
                rows << 20
            );
        }
        burn_step(&model, rows)
    })
    .unwrap();
    assert!((95..=100).contains(&report.max_batch), "{report}");
}
