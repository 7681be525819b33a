//! Hostile pass on public functions: results that must be true, no panics, no hangs.

use oomguard_runtime::alloc::{peak_live, plan_static_layout, LifeSpan, StaticLayout};

fn span(start: usize, end: usize, bytes: u64) -> LifeSpan {
    LifeSpan { start, end, bytes }
}

/// `StaticLayout::conflict` overflows (`ob + b.bytes`, a debug-build panic) on two blocks of
/// 2^63 bytes placed side by side, a valid layout whose top block ends at 2^64.
#[test]
fn conflict_of_blocks_ending_at_2_64_does_not_overflow() {
    let spans = [span(0, 2, 1 << 63), span(0, 2, 1 << 63)];
    let side_by_side = StaticLayout {
        offsets: vec![0, 1 << 63],
        height: u64::MAX,
        tries: 1,
    };
    assert_eq!(side_by_side.conflict(&spans), None);
    let overlapping = StaticLayout {
        offsets: vec![1 << 63, u64::MAX],
        height: u64::MAX,
        tries: 1,
    };
    assert_eq!(overlapping.conflict(&spans), Some((0, 1)));
}

/// `peak_live` counts a zero-length span (live at no event, by `LifeSpan`'s doc) as if it
/// stayed live: 300 for two blocks never live together, above the height (200) of a layout
/// `plan_static_layout` finds and `conflict` accepts, while it claims to be a lower bound of
/// every layout's height. An inverted span (end before start) does the same (200 vs 100).
#[test]
fn peak_live_is_a_lower_bound_with_zero_length_and_inverted_spans() {
    for spans in [
        vec![span(3, 3, 200), span(4, 6, 100)],
        vec![span(5, 3, 100), span(6, 8, 100)],
    ] {
        let l = plan_static_layout(&spans, 10, 1);
        assert_eq!(l.conflict(&spans), None, "{spans:?}");
        assert!(
            peak_live(&spans) <= l.height,
            "{spans:?}: peak_live {} above a valid layout's height {}",
            peak_live(&spans),
            l.height
        );
    }
}

/// Three blocks of 2^63 bytes live at once have no layout in 64-bit offsets: the layout says so
/// as its doc does (height `u64::MAX`, `conflict` names the overlap), and nothing panics
/// (`conflict` overflowed before).
#[test]
fn a_layout_past_2_64_says_so() {
    let spans = [
        span(0, 2, 1 << 63),
        span(0, 2, 1 << 63),
        span(0, 2, 1 << 63),
    ];
    let l = plan_static_layout(&spans, 5, 1);
    assert_eq!(l.height, u64::MAX, "{l:?}");
    assert!(l.conflict(&spans).is_some(), "{l:?}");
    // two of them end exactly at 2^64: a valid layout, its height saturated
    let two = plan_static_layout(&spans[..2], 5, 1);
    assert_eq!(two.conflict(&spans[..2]), None, "{two:?}");
}
