//! One plain tch training step, no oomguard: forward, backward, optimizer step, zero_grad; the
//! device synchronised before it returns (so a clock around it measures the step).

use oomguard_tch::{catch_oom, Error};
use tch::{nn, Device, Tensor};

use crate::charge::Charge;
use crate::model::Gpt;

/// Waits for `dev`'s work (nothing on the CPU); an out-of-memory reported there is an error.
pub fn sync(dev: Device) -> Result<(), Error> {
    if let Device::Cuda(i) = dev {
        catch_oom(|| {
            tch::Cuda::synchronize(i as i64);
            Ok::<_, Error>(())
        })?;
    }
    Ok(())
}

/// One step over `tokens` `(rows, seq + 1)`, holding its rows on `charge`'s card while it
/// runs: the loss value. tch's `Optimizer::step` and
/// `zero_grad` panic on a libtorch error; an out-of-memory panic is caught as an error. The
/// gradients are set to none afterwards on every path (libtorch's `zero_grad` frees them), so a
/// failed step leaves none behind for the next.
pub fn plain_step(
    model: &Gpt,
    opt: &mut nn::Optimizer,
    tokens: &Tensor,
    dev: Device,
    charge: &Charge,
) -> Result<f64, Error> {
    let r = catch_oom(|| {
        let _rows = charge.rows(tokens.size()[0])?;
        let loss = model.loss(tokens)?;
        loss.f_backward()?;
        opt.step();
        let v = loss.f_double_value(&[])?;
        sync(dev)?;
        Ok::<_, Error>(v)
    });
    let z = catch_oom(|| {
        opt.zero_grad();
        Ok::<_, Error>(())
    });
    let v = r?;
    z?;
    Ok(v)
}
