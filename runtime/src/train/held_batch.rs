//! What a training finder learns about the batch itself: the bytes its tensors hold for the
//! whole step, per row, so that an engine seeded from the finder leaves room for a larger
//! batch's tensors ([`FinderReport::micro_batch_for`]).

use std::cell::Cell;

use crate::retry::FinderReport;
use crate::source::MemorySource;

/// The bytes per row that batches made inside a finder's runs held, measured on the source
/// (its used bytes before and after `make_batch`). The framework crates'
/// `find_max_batch_train` measure each batch with [`HeldBatch::measure`] and put the result in
/// the report with [`HeldBatch::into_report`].
#[derive(Debug, Default)]
pub struct HeldBatch {
    per_row: Cell<u64>,
}

impl HeldBatch {
    /// Nothing measured yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Runs `make` (which makes a batch of `rows` rows) and records the bytes per row the
    /// source's used memory rose by (the largest over every call; nothing when the source
    /// cannot say, or when the batch lives elsewhere, such as host memory).
    pub fn measure<S, T>(&self, source: &S, rows: usize, make: impl FnOnce() -> T) -> T
    where
        S: MemorySource + ?Sized,
    {
        let before = source.usage().map(|u| u.used).ok();
        let batch = make();
        if let (Some(before), Ok(after)) = (before, source.usage()) {
            let per_row = after
                .used
                .saturating_sub(before)
                .div_ceil(rows.max(1) as u64);
            self.per_row.set(self.per_row.get().max(per_row));
        }
        batch
    }

    /// `report` with [`FinderReport::batch_bytes_per_row`] set to what was measured (left
    /// `None` when no batch held device memory).
    pub fn into_report(self, mut report: FinderReport) -> FinderReport {
        let per_row = self.per_row.get();
        if per_row > 0 {
            report.batch_bytes_per_row = Some(per_row);
        }
        report
    }
}
