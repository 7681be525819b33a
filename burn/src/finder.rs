//! `find_max_batch` on a burn step: the runtime's finder, with each run under [`catch_oom`].

use oomguard::retry::{FinderError, FinderOptions, FinderReport};
use oomguard::source::MemorySource;

use crate::{catch_oom, Error};

/// The largest batch for which `step(rows)` runs without out-of-memory on `source`
/// ([`oomguard::retry::find_max_batch`]: two measured runs, a linear fit of peak memory, a
/// jump; at most 4 runs when memory is affine in the batch). Each run is under
/// [`catch_oom`], so a cubecl out-of-memory panic is a failed run, not a crash. The step should
/// do what a training step does (forward, backward, optimizer), keep nothing between calls, and
/// read something it computed (e.g. the loss with `try_into_data`) so that its errors surface.
///
/// **It trains the model it measures**: every trial runs real steps, optimizer update included
/// (2 per trial, then 32 or more to verify the batch found; [`FinderReport::step_runs`] counts
/// them), so the model and the optimizer's state change. Measure on a clone of the model and
/// a fresh optimizer, or keep the records (`Module::into_record`, `Optimizer::to_record`) and
/// load them back after. Start `train_step` from the batch found with
/// [`RetryEngine::start_from_finder`](oomguard::retry::RetryEngine::start_from_finder).
pub fn find_max_batch<S, T>(
    source: &S,
    opts: FinderOptions,
    mut step: impl FnMut(usize) -> Result<T, Error>,
) -> Result<FinderReport, FinderError<Error>>
where
    S: MemorySource + ?Sized,
{
    oomguard::retry::find_max_batch(source, opts, |rows| catch_oom(|| step(rows)))
}
