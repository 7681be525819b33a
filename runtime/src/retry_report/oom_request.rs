//! The request an out-of-memory failed on, against the most that could ever serve it.

/// One failed request against the most that could ever serve it ([`IsOom::oom_request`]).
///
/// [`IsOom::oom_request`]: crate::retry::IsOom::oom_request
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OomRequest {
    /// Bytes the failed request asked for.
    pub requested: u64,
    /// The device's total capacity, or the budget's limit ([`OomRequest::budget`]).
    pub capacity: u64,
    /// Whether `capacity` is a memory budget's limit rather than the device's capacity.
    pub budget: bool,
}

impl OomRequest {
    /// Whether the request is larger than the whole capacity: no emptied cache, no freed
    /// buffer makes it fit; only a smaller request can.
    pub fn exceeds_capacity(&self) -> bool {
        self.requested > self.capacity
    }
}

impl std::fmt::Display for OomRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let what = if self.budget {
            "the budget's whole limit"
        } else {
            "the device's whole capacity"
        };
        write!(
            f,
            "a request of {} against {what} of {}",
            crate::ByteSize(self.requested),
            crate::ByteSize(self.capacity)
        )
    }
}
