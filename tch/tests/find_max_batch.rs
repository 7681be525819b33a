//! `oomguard_tch::find_max_batch` on a tch step (CPU): the step's memory is a simulated card
//! charged per row, and a libtorch out-of-memory raised as the *panic* of a plain tch method past
//! some rows is a failed run of the search, not a crash.

use oomguard::retry::FinderOptions;
use oomguard::ByteSize;
use oomguard_tch::{find_max_batch, Error};
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

#[test]
fn finds_the_batch_a_tch_step_fits_through_oom_panics() {
    let vs = nn::VarStore::new(Device::Cpu);
    let model = nn::linear(vs.root(), 4, 1, Default::default());
    let mut sgd = nn::Sgd::default().build(&vs, 0.01).unwrap();
    let mut step = |rows: usize| -> Result<f64, Error> {
        let x = Tensor::f_ones([rows as i64, 4], (Kind::Float, Device::Cpu))?;
        let loss = model.forward(&x).f_square()?.f_mean(Kind::Float)?;
        sgd.zero_grad();
        loss.f_backward()?;
        sgd.step();
        Ok(loss.f_double_value(&[])?)
    };
    let sim = oomguard::Device::sim(ByteSize::mib(256));
    // 16 MiB of workspace plus 1 MiB of activations per row: about 240 rows fit.
    let report = find_max_batch(&sim, FinderOptions::default(), |rows| {
        let _ws = sim.alloc::<u8>(16 << 20)?;
        let _acts = sim.alloc::<u8>(rows << 20)?;
        step(rows)
    })
    .unwrap();
    assert!((228..=240).contains(&report.max_batch), "{report}");
    assert!(report.runs() <= 4, "{report}");

    // libtorch's own out-of-memory, as the panic of a plain method, past 100 rows.
    let report = find_max_batch(&sim, FinderOptions::default(), |rows| {
        let _acts = sim.alloc::<u8>(rows << 20)?;
        if rows > 100 {
            let _huge = Tensor::empty([1i64 << 50], (Kind::Float, Device::Cpu));
            // 4 PiB
        }
        step(rows)
    })
    .unwrap();
    assert!((95..=100).contains(&report.max_batch), "{report}");
}
