//! [`FinderOptions`]: the settings of [`find_max_batch`](crate::retry::find_max_batch).

/// Settings of [`find_max_batch`](crate::retry::find_max_batch).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FinderOptions {
    /// Rows of the first probe (at least 1).
    pub start: usize,
    /// The largest batch worth having (the search never goes above it).
    pub max: usize,
    /// Fraction of the memory left for the rows that is kept free as a safety margin on the
    /// jump (fragmentation, rounding), in `[0, 1)`.
    pub margin: f64,
    /// After a jump that ran with the peak the fit predicted, refit on the widest two points and
    /// try the refined prediction (one more run, with half the margin).
    pub refine: bool,
    /// Most trials in all (each runs the step [`FinderOptions::steps_per_trial`] times).
    pub max_trials: u32,
    /// Steps each trial runs back to back, without emptying the cache between them (at least
    /// 1; default 2): a batch counts as fitting only when every one of them ran. A loop of
    /// steps meets the memory the previous step left cached and fragmented, which a single step
    /// from an emptied cache does not (on the driver pool, single-step trials found batches
    /// that ran out of memory on the next step): with 2, the batch found is one that ran two
    /// consecutive steps on the source measured.
    pub steps_per_trial: u32,
    /// Consecutive steps the batch found must then run, without emptying the cache between
    /// them, before it is returned (default 32; 0: no verification). A source that fragments
    /// step after step fails here: on an H100, candle's GPT-2 loop on the driver's pool ran 20
    /// steps at the batch the search found (two steps per trial; 8 in a verification), then
    /// ran out of memory at every step (docs/GPU.md run 15c), so the default covers 32. The
    /// finder then steps down (by a fifth, then by halves, then bisecting between the largest
    /// batch verified and the smallest that failed, to within 5%) and returns the largest
    /// batch verified, in at most [`MAX_VERIFICATIONS`] verification runs. A loop that fails
    /// only after more steps than a verification ran is not caught.
    pub verify_steps: u32,
}

/// A verification whose held memory still rises runs up to this many times
/// [`FinderOptions::verify_steps`] steps (see [`find_max_batch`](crate::retry::find_max_batch)).
pub const VERIFY_EXTENSION: u32 = 2;

/// Most verification runs (of [`FinderOptions::verify_steps`] steps each) after the search;
/// if none of them ran all its steps, [`find_max_batch`](crate::retry::find_max_batch) fails with
/// [`FinderError::LoopFails`](crate::retry::FinderError::LoopFails).
pub const MAX_VERIFICATIONS: usize = 12;

/// The defaults: `start` 1 row, `max` 2^20 rows, `margin` 0.03, `refine` on, `max_trials` 16,
/// `steps_per_trial` 2, `verify_steps` 32.
impl Default for FinderOptions {
    fn default() -> Self {
        Self {
            start: 1,
            max: 1 << 20,
            margin: 0.03,
            refine: true,
            max_trials: 16,
            steps_per_trial: 2,
            verify_steps: 32,
        }
    }
}
