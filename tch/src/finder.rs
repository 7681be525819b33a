//! `find_max_batch` on a tch step: the runtime's finder, with each run under [`catch_oom`].

use oomguard::retry::{FinderError, FinderOptions, FinderReport};
use oomguard::source::MemorySource;

use crate::quiet_panics::QuietOomPanics;
use crate::{catch_oom, Error};

/// The largest batch for which `step(rows)` runs without out-of-memory on `source`
/// ([`oomguard::retry::find_max_batch`]: two measured runs, a linear fit of peak memory, a
/// jump; at most 4 runs when memory is affine in the batch). Each run is under [`catch_oom`], so
/// a libtorch out-of-memory raised as the panic of a plain tch method is a failed run, not a
/// crash; an `f_*` method's is returned through `?`. The panic hook stays quiet for those
/// out-of-memory panics (on this thread, during this call): a search that fails a dozen runs
/// prints nothing for them; the report's runs say which failed. Every other panic prints. The step should do what a training step
/// does (forward, backward, optimizer), keep nothing between calls, and read something it
/// computed (e.g. the loss with `f_double_value`) so that its errors surface.
///
/// **It trains the model it measures**: every trial runs real steps, optimizer update included
/// (2 per trial, then 32 or more to verify the batch found; [`FinderReport::step_runs`] counts
/// them), so the variables and the optimizer's state change. Measure on a copy
/// (`VarStore::copy` into a second store with its own optimizer), or save the store
/// (`VarStore::save`) and load it back after. Start [`train_step`](crate::train_step) from the
/// batch found with
/// [`RetryEngine::start_from_finder`](oomguard::retry::RetryEngine::start_from_finder).
///
/// ```
/// use oomguard::retry::FinderOptions;
/// use oomguard_tch::find_max_batch;
/// use tch::{Device, Kind, Tensor};
///
/// // A simulated 64 MiB card, 1 MiB of activations per row: about 64 rows fit.
/// let card = oomguard::Device::sim(oomguard::ByteSize::mib(64));
/// let found = find_max_batch(&card, FinderOptions::default(), |rows| {
///     let _activations = card.alloc::<u8>(rows << 20)?;
///     let x = Tensor::f_ones([rows as i64, 4], (Kind::Float, Device::Cpu))?;
///     Ok(x.f_sum(Kind::Float)?.f_double_value(&[])?)
/// })
/// .unwrap();
/// assert!((56..=64).contains(&found.max_batch), "{found}");
/// ```
pub fn find_max_batch<S, T>(
    source: &S,
    opts: FinderOptions,
    mut step: impl FnMut(usize) -> Result<T, Error>,
) -> Result<FinderReport, FinderError<Error>>
where
    S: MemorySource + ?Sized,
{
    let _quiet = QuietOomPanics::enter();
    oomguard::retry::find_max_batch(source, opts, |rows| catch_oom(|| step(rows)))
}
