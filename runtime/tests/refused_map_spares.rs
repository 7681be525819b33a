//! A map the device refuses after free pages were moved for it: the retry counts the pages the
//! first attempt moved (their handles are spares the device still holds) and moves only what
//! is still missing, so no page is unmapped for nothing.

use std::sync::Arc;

use oomguard_runtime::alloc::CachingAllocator;
use oomguard_runtime::backend::sim::{SimDevice, SimOp};
use oomguard_runtime::{AllocatorConfig, ByteSize};

const MIB: u64 = 1 << 20;

#[test]
fn a_refused_map_after_a_move_moves_only_the_pages_still_missing() {
    // 40 MiB device; sixteen 2 MiB blocks, every other one freed (the last one kept, so that
    // the request cannot extend a free run at the end of the range): 32 MiB mapped, eight
    // free runs of one page each in holes.
    let sim = SimDevice::address_only(ByteSize::mib(40));
    let a = CachingAllocator::new(
        Arc::new(sim.clone()),
        AllocatorConfig::parse("expandable_segments:True").unwrap(),
    );
    let xs: Vec<_> = (0..16).map(|_| a.allocate(2 * MIB, 0).unwrap()).collect();
    let mut kept = Vec::new();
    for (i, x) in xs.into_iter().enumerate() {
        if i % 2 == 0 {
            a.free(x).unwrap();
        } else {
            kept.push(x);
        }
    }
    assert_eq!(a.stats().reserved_bytes.all.current, 32 * MIB);
    // 10 MiB fits in no hole: 32 + 10 passes the 40 MiB device by 2 MiB, so one free page is
    // moved (kept as a spare) and the map is asked for. The device refuses that map once.
    sim.faults().fail_nth_op(SimOp::Map, 0);
    let before = sim.calls();
    let big = a.allocate(10 * MIB, 0).unwrap();
    let after = sim.calls();
    let st = a.stats();
    // The request needs 10 MiB of pages: the 2 MiB spare the first attempt kept plus 8 MiB
    // more. Moving a full 10 MiB again would unmap 12 MiB and release a page just moved.
    assert_eq!(
        st.unmapped_bytes_total,
        10 * MIB,
        "pages unmapped for a 10 MiB request: {st:?}"
    );
    assert_eq!(
        after.pages_released - before.pages_released,
        0,
        "no moved page left over and released: {before:?} -> {after:?}"
    );
    assert_eq!(after.pages_reused - before.pages_reused, 5, "{after:?}");
    assert_eq!(sim.used(), st.reserved_bytes.all.current);
    assert_eq!((st.num_ooms, st.num_alloc_retries), (0, 0), "{st:?}");
    a.free(big).unwrap();
    for x in kept {
        a.free(x).unwrap();
    }
    a.check_invariants().unwrap();
}
