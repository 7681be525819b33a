//! Hostile pass on device buffers and scoped guards: figures that must be true.

use oomguard_runtime::source::MemorySource;
use oomguard_runtime::{ByteSize, Device};

/// `available()` under a byte budget said the budget's raw remainder (1000; 4196 − 512) could be
/// handed out, but budgets count 512-byte blocks: an allocation of that many bytes was refused.
#[test]
fn available_under_a_budget_is_a_size_the_budget_lets_through() {
    let d = Device::sim(ByteSize::mib(64));
    {
        let _b = d.thread_budget(ByteSize::b(1000));
        let av = d.available().unwrap();
        assert!(av <= 1000, "{av}");
        d.alloc::<u8>(av as usize)
            .unwrap_or_else(|e| panic!("available() said {av} bytes, allocating them: {e}"));
    }
    {
        let b = d.thread_budget(ByteSize::b(4096 + 100));
        let _x = d.alloc::<u8>(100).unwrap();
        assert_eq!(b.used(), 512);
        let av = d.available().unwrap();
        d.alloc::<u8>(av as usize)
            .unwrap_or_else(|e| panic!("available() said {av} bytes, allocating them: {e}"));
        assert_eq!(av, 3584);
    }
}
