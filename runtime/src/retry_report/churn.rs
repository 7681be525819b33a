//! Allocator churn: the work a memory source does under pressure that a settled training loop
//! does not (what the retry engine's thrash detection watches).

use std::fmt;

/// Counters of the work a memory source did under pressure: the cache freed and an allocation
/// retried, pages unmapped (to be mapped elsewhere: pages moved), synchronisations inside the
/// allocator. Mapping new pages while there is room is not churn: the first steps of any loop do
/// it, and a settled loop stops. Counters only grow; [`Churn::since`] gives a step's share.
///
/// Made by [`MemorySource::churn`](crate::source::MemorySource::churn); a source that cannot tell
/// leaves a counter at 0 (the default implementation counts allocator retries only).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Churn {
    /// Times the source freed its cache and retried an allocation after the device refused it.
    pub alloc_retries: u64,
    /// Unmap calls (growable segments giving pages back, to map them where a request fits).
    pub unmaps: u64,
    /// Bytes of pages unmapped.
    pub unmapped_bytes: u64,
    /// Synchronisations inside the allocator: with every stream (before releasing its cache, on
    /// `empty_cache`) or with the streams of the pages it moved.
    pub syncs: u64,
}

impl Churn {
    /// Churn counting only `alloc_retries` allocator retries (sources that cannot tell more).
    pub fn retries(alloc_retries: u64) -> Self {
        Self {
            alloc_retries,
            ..Self::default()
        }
    }

    /// What happened between `before` and `self` (two readings of one source; a counter reset
    /// in between counts 0).
    pub fn since(&self, before: &Churn) -> Churn {
        Churn {
            alloc_retries: self.alloc_retries.saturating_sub(before.alloc_retries),
            unmaps: self.unmaps.saturating_sub(before.unmaps),
            unmapped_bytes: self.unmapped_bytes.saturating_sub(before.unmapped_bytes),
            syncs: self.syncs.saturating_sub(before.syncs),
        }
    }

    /// Whether any counter is non-zero: in a step's share, the step churned.
    pub fn any(&self) -> bool {
        self.alloc_retries != 0 || self.unmaps != 0 || self.unmapped_bytes != 0 || self.syncs != 0
    }
}

/// `2 allocator retries, 3 unmaps (96.00 MiB), 4 synchronisations`; `none` when nothing.
impl fmt::Display for Churn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if !self.any() {
            return f.write_str("none");
        }
        let plural =
            |n: u64, one: &'static str, many: &'static str| if n == 1 { one } else { many };
        let mut parts = Vec::new();
        if self.alloc_retries != 0 {
            parts.push(format!(
                "{} allocator retr{}",
                self.alloc_retries,
                plural(self.alloc_retries, "y", "ies")
            ));
        }
        if self.unmaps != 0 || self.unmapped_bytes != 0 {
            parts.push(format!(
                "{} unmap{} ({} of pages moved)",
                self.unmaps,
                plural(self.unmaps, "", "s"),
                crate::ByteSize(self.unmapped_bytes)
            ));
        }
        if self.syncs != 0 {
            parts.push(format!(
                "{} synchronisation{}",
                self.syncs,
                plural(self.syncs, "", "s")
            ));
        }
        f.write_str(&parts.join(", "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn since_any_and_display() {
        let before = Churn {
            alloc_retries: 1,
            unmaps: 2,
            unmapped_bytes: 4 << 20,
            syncs: 3,
        };
        let after = Churn {
            alloc_retries: 1,
            unmaps: 3,
            unmapped_bytes: 6 << 20,
            syncs: 4,
        };
        let d = after.since(&before);
        assert_eq!(
            d,
            Churn {
                alloc_retries: 0,
                unmaps: 1,
                unmapped_bytes: 2 << 20,
                syncs: 1
            }
        );
        assert!(d.any());
        assert!(!after.since(&after).any());
        // a reset in between counts nothing, not a wrapped huge number
        assert!(!Churn::default().since(&after).any());
        assert_eq!(
            d.to_string(),
            "1 unmap (2.00 MiB of pages moved), 1 synchronisation"
        );
        assert_eq!(Churn::retries(2).to_string(), "2 allocator retries");
        assert_eq!(Churn::default().to_string(), "none");
    }
}
