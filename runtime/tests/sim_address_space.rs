//! The simulated device's address space: ranges given back are used again, and a device near
//! 2^64 bytes still serves (a hostile pass of the public API found both failing with "reserve:
//! size too large", not an out-of-memory, on an empty device).

use oomguard_runtime::{ByteSize, Device};

/// A 1 PiB card reserves a device-sized range for each pool and stream, and again after each
/// `empty_cache`: the 64-bit space held 16,383 of them, then every allocation failed.
#[test]
fn ranges_given_back_are_reused() {
    let d = Device::sim(ByteSize(1 << 50));
    for i in 0..20_000 {
        let b = d
            .alloc::<u8>(4 << 20)
            .unwrap_or_else(|e| panic!("cycle {i}: {e}"));
        drop(b);
        d.empty_cache().unwrap();
    }
}

/// A card of u64::MAX bytes (what `ByteSize::gib(u64::MAX)` saturates to) holds one
/// device-sized range; the next pool's range is the request's pages.
#[test]
fn a_card_near_2_pow_64_serves_both_pools() {
    let d = Device::sim(ByteSize::gib(u64::MAX));
    let small = d.alloc::<u8>(1).unwrap();
    let large = d.alloc::<u8>(2 << 20).unwrap();
    let more = d.alloc::<u8>(64 << 20).unwrap();
    assert_eq!(
        d.stats().allocated_bytes.all.current,
        512 + (2 << 20) + (64 << 20)
    );
    drop((small, large, more));
    let e = d.alloc::<u8>(usize::MAX).unwrap_err();
    assert!(e.is_oom(), "{e}");
}

/// Streams of a 2^60-byte card each reserve a device-sized range: the space held 15.
#[test]
fn many_streams_of_a_huge_card_each_get_a_range() {
    let d = Device::sim(ByteSize(1 << 60));
    let held: Vec<_> = (0..64)
        .map(|s| {
            d.alloc_on::<u8>(4 << 20, s)
                .unwrap_or_else(|e| panic!("stream {s}: {e}"))
        })
        .collect();
    assert_eq!(held.len(), 64);
}
