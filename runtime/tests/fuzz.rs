//! A stable-toolchain fuzz harness: each target starts from its checked-in corpus
//! (`tests/fuzz_corpus/TARGET/`), mutates inputs (bit flips, byte edits, insertions, deletions,
//! splices) for a bounded number of cases, and fails on any panic or broken property, printing
//! the input. Deterministic (fixed seed), so a failure reproduces.

use std::path::Path;
use std::sync::Arc;

use oomguard_runtime::backend::sim::SimDevice;
use oomguard_runtime::backend::Backend;
use oomguard_runtime::{Allocation, AllocatorConfig, ByteSize, CachingAllocator};

/// Runs a target over its corpus `tests/fuzz_corpus/TARGET` and `cases` mutants.
fn fuzz(target: &str, cases: usize, check: impl Fn(&[u8])) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fuzz_corpus")
        .join(target);
    oomguard_runtime::fuzzing::fuzz_test(&dir, cases, check);
}

#[test]
fn fuzz_config_parser() {
    fuzz("config", 20_000, |input| {
        let s = String::from_utf8_lossy(input);
        if let Ok(c) = AllocatorConfig::parse(&s) {
            // whatever parses prints back to an equal configuration
            let again = AllocatorConfig::parse(&c.to_string()).expect("printed config parses");
            assert_eq!(again, c, "round trip of {s:?}");
            // and the allocator runs with it: sizes from the input (small to absurd) are served
            // or refused with an error, never a panic, and the state stays consistent
            let sim = SimDevice::address_only(ByteSize::gib(1));
            let a = CachingAllocator::new(Arc::new(sim.clone()), c);
            let mut live = Vec::new();
            for (i, w) in input.chunks(8).enumerate() {
                let mut b = [0u8; 8];
                b[..w.len()].copy_from_slice(w);
                let x = u64::from_le_bytes(b);
                let size = match i % 4 {
                    0 => x % 4096,
                    1 => x % (64 << 20),
                    2 => x >> (x % 64),
                    _ => u64::MAX - x % (8 << 20),
                };
                match a.allocate(size, 0) {
                    Ok(al) => live.push(al),
                    Err(e) => assert!(
                        e.is_oom() || matches!(e, oomguard_runtime::Error::InvalidArgument(_)),
                        "{s:?} size {size}: {e}"
                    ),
                }
            }
            a.check_invariants().unwrap();
            for al in live {
                a.free(al).unwrap();
            }
            a.empty_cache().unwrap();
            assert_eq!(sim.used(), 0, "{s:?}");
        } else {
            let e = AllocatorConfig::parse(&s).unwrap_err();
            assert!(e.to_string().contains("valid keys"), "{e}");
        }
    });
}

#[test]
fn fuzz_byte_size_parser() {
    fuzz("bytesize", 20_000, |input| {
        let s = String::from_utf8_lossy(input);
        match s.parse::<ByteSize>() {
            Ok(b) => {
                // parsing its own rendering gives a value within the 2-decimal rounding
                let back: ByteSize = b.to_string().parse().expect("printed size parses");
                assert!(back.0.abs_diff(b.0) as f64 <= b.0 as f64 * 0.005 + 1.0);
            }
            Err(e) => assert_eq!(e.input, s),
        }
    });
}

/// Allocator operations decoded from bytes, checked against a reference model: the live set
/// (no overlaps; stats equal it), reserved bytes equal the device's usage, out-of-memory only
/// when the request cannot fit in the pages the live blocks leave free (growable mode: an exact
/// page count, not a slack), and nothing reserved after freeing all and emptying the cache.
#[test]
fn fuzz_allocator_against_a_model() {
    fuzz("alloc_ops", 3_000, |input| {
        let Some((&mode, ops)) = input.split_first() else {
            return;
        };
        let growable = mode % 2 == 0;
        let cap = 64u64 << 20;
        let sim = SimDevice::address_only(ByteSize(cap));
        let cfg = if growable {
            AllocatorConfig::default()
        } else {
            AllocatorConfig::native()
        };
        let a = CachingAllocator::new(Arc::new(sim.clone()), cfg);
        let mut live: Vec<Allocation> = Vec::new();
        for op in ops.chunks(3) {
            let (kind, x, y) = (
                op[0],
                *op.get(1).unwrap_or(&0) as u64,
                *op.get(2).unwrap_or(&0) as u64,
            );
            match kind % 8 {
                0..=3 => {
                    // sizes from 1 byte to ~40 MiB, spread over both pools
                    let size = match kind % 4 {
                        0 => x * 16 + y,
                        1 => (x << 12) + y,
                        2 => (x << 16) + (y << 8),
                        _ => (x % 40 + 1) << 20,
                    };
                    let stream = y % 2;
                    match a.allocate(size, stream) {
                        Ok(al) => {
                            assert!(al.size >= size && al.ptr % 512 == 0);
                            for o in &live {
                                assert!(
                                    al.ptr + al.size <= o.ptr || o.ptr + o.size <= al.ptr,
                                    "overlap"
                                );
                            }
                            live.push(al);
                        }
                        Err(e) => {
                            assert!(e.is_oom(), "{e}");
                            if growable {
                                // Before failing, the allocator waits for pending frees and
                                // unmaps every page that holds no live byte, so the device holds
                                // exactly the pages the live blocks touch; the request needs at
                                // most its own size in whole pages. OOM is right only if those
                                // cannot fit.
                                let g = 2u64 << 20;
                                let mut pages = std::collections::BTreeSet::new();
                                for l in &live {
                                    pages.extend(l.ptr / g..(l.ptr + l.size).div_ceil(g));
                                }
                                let need = size.div_ceil(g);
                                assert!(
                                    (pages.len() as u64 + need) * g > cap,
                                    "OOM for {size} ({need} pages) with {} pages live of {}",
                                    pages.len(),
                                    cap / g
                                );
                            }
                        }
                    }
                }
                4 | 5 if !live.is_empty() => {
                    let l = live.swap_remove(x as usize % live.len());
                    a.free(l).unwrap();
                }
                6 => a.empty_cache().unwrap(),
                7 if !live.is_empty() => {
                    let l = live[x as usize % live.len()];
                    a.record_stream(&l, 1 - l.stream).unwrap();
                }
                _ => {}
            }
            a.check_invariants().unwrap();
            let s = a.stats();
            assert_eq!(
                s.allocated_bytes.all.current,
                live.iter().map(|l| l.size).sum::<u64>()
            );
            assert_eq!(s.reserved_bytes.all.current, sim.used());
            assert!(sim.mem_info().unwrap().free <= cap);
        }
        for l in live {
            a.free(l).unwrap();
        }
        a.empty_cache().unwrap();
        assert_eq!(a.stats().reserved_bytes.all.current, 0);
        assert_eq!(sim.used(), 0);
    });
}
