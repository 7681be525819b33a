//! On the CPU, a simulated card gives the steps an out-of-memory to meet: every step (and every
//! micro-batch of a guarded step) holds `per_row` bytes of it per row while it runs, as the
//! activations of a real card would. On CUDA nothing is charged: libtorch's own allocator runs
//! out.

use oomguard::DeviceBuffer;

/// Bytes charged per row on the simulated card, or nothing.
pub struct Charge {
    sim: Option<oomguard::Device>,
    per_row: usize,
}

impl Charge {
    /// Nothing charged (a real device).
    pub fn none() -> Self {
        Self {
            sim: None,
            per_row: 0,
        }
    }

    /// `per_row` bytes a row on the simulated card `card`.
    pub fn on(card: oomguard::Device, per_row: usize) -> Self {
        Self {
            sim: Some(card),
            per_row,
        }
    }

    /// The simulated card, when there is one.
    pub fn card(&self) -> Option<&oomguard::Device> {
        self.sim.as_ref()
    }

    /// Holds `rows` rows' worth of the simulated card until the buffer drops (`None` on a
    /// real device); its out-of-memory when they do not fit.
    pub fn rows(&self, rows: i64) -> Result<Option<DeviceBuffer<u8>>, oomguard::Error> {
        match &self.sim {
            Some(s) => Ok(Some(s.alloc::<u8>(rows.max(0) as usize * self.per_row)?)),
            None => Ok(None),
        }
    }
}
