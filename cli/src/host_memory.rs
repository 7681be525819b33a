//! The command's allocator: the system's, except that host memory the machine refuses ends the
//! command with one line and exit status 2, not Rust's abort (exit 134 and a backtrace).
//!
//! A trace can parse and still need more of this machine's memory to replay than it has (millions
//! of blocks live at once), and nothing bounds that in advance without refusing traces that do
//! fit. Readers that can recover from a refusal (`Vec::try_reserve`) do so under [`fallible`],
//! where a refusal is returned to them as usual.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

thread_local! {
    /// Inside [`fallible`] on this thread: a refusal goes back to the caller. A `const` cell:
    /// reading it allocates nothing, so the allocator may read it.
    static FALLIBLE: Cell<bool> = const { Cell::new(false) };
}

/// Runs `f` with refused allocations returned to it (for `try_reserve`), not ending the command.
pub fn fallible<T>(f: impl FnOnce() -> T) -> T {
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            FALLIBLE.with(|c| c.set(self.0));
        }
    }
    let _restore = Restore(FALLIBLE.with(|c| c.replace(true)));
    f()
}

/// The `oomguard` binary's global allocator (see the module doc).
pub struct ExitOnRefusal;

impl ExitOnRefusal {
    /// `ptr`, or the end of the command when the system refused `bytes` outside [`fallible`].
    fn checked(ptr: *mut u8, bytes: usize) -> *mut u8 {
        if ptr.is_null() && !FALLIBLE.with(Cell::get) {
            out_of_host_memory(bytes);
        }
        ptr
    }
}

// SAFETY: every method forwards to `System` with the caller's arguments unchanged and returns
// what it returned (or does not return at all), so `System`'s guarantees are ours.
unsafe impl GlobalAlloc for ExitOnRefusal {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller upholds `alloc`'s contract (a non-zero size), passed on unchanged.
        Self::checked(unsafe { System.alloc(layout) }, layout.size())
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as `alloc`.
        Self::checked(unsafe { System.alloc_zeroed(layout) }, layout.size())
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from this allocator, that is from `System`, with `layout`.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: `ptr` came from `System` with `layout`; the caller upholds `new_size`'s rules.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        Self::checked(p, new_size)
    }
}

/// Writes the one line and ends the process with status 2. It allocates nothing (the line is
/// formatted on the stack) and runs no exit handler (another thread may hold a lock that one
/// would take).
fn out_of_host_memory(bytes: usize) -> ! {
    let mut line = StackLine::default();
    let _ = refusal_line(&mut line, bytes);
    exit_now(line.as_bytes())
}

/// The line for a refusal of `bytes` (MiB beside bytes from 1 MiB on).
fn refusal_line(line: &mut impl std::fmt::Write, bytes: usize) -> std::fmt::Result {
    write!(
        line,
        "oomguard: out of host memory: this machine refused {bytes} bytes"
    )?;
    if bytes >= 1 << 20 {
        write!(line, " ({:.1} MiB)", bytes as f64 / (1u64 << 20) as f64)?;
    }
    writeln!(
        line,
        " more; the command needs more of the machine's memory than it has (or than a limit \
         such as `ulimit -v` allows): use a machine with more memory, or a smaller input (a \
         shorter trace, fewer `--steps`)"
    )
}

/// Makes every thread take its memory from the process's one heap (glibc's main arena) instead
/// of a heap of its own, before the command starts threads (`replay --threads` starts one per
/// recorded thread).
///
/// glibc gives each new thread an arena that reserves 64 MiB of address space on its first
/// allocation. Under an address-space limit (`ulimit -v`) that reservation can fail inside the
/// thread's start, where glibc registers the thread's destructors and aborts the process
/// ("Fatal glibc error: failed to register TLS destructor: out of memory", exit 134; 9 runs in
/// 40 at `ulimit -v 280000` with 1,024 recorded threads) instead of the command's one line.
/// With one arena a thread's start costs its stack alone, so the limit is met where the thread
/// is created and the replay stops with its error. The replay calls the allocator from one
/// thread at a time, so one arena costs it no contention. Elsewhere than glibc: nothing.
pub fn one_heap_for_all_threads() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: `mallopt` takes two integers and changes only the arena limit of glibc's
    // allocator, which every later allocation of any thread honours; it is called before this
    // command starts its worker threads.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 1);
    }
}

/// Whether the process can map `bytes` more of address space now: a mapping of that size with
/// no access (no memory behind it: Linux charges no commit for it) is made and unmapped at once
/// (`MAP_NORESERVE` is left out: FreeBSD has none). What a limit such as
/// `ulimit -v` allows is then known before a thread is started, whose own start (its signal
/// stack, its destructors) has no way to report a refusal but a panic or an abort.
pub fn address_space_for(bytes: usize) -> bool {
    #[cfg(unix)]
    {
        // SAFETY: a new anonymous mapping with no access at an address the kernel picks touches
        // no existing memory; it is unmapped with the address and length `mmap` returned.
        unsafe {
            let p = libc::mmap(
                std::ptr::null_mut(),
                bytes,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            );
            if p == libc::MAP_FAILED {
                return false;
            }
            libc::munmap(p, bytes);
        }
        true
    }
    #[cfg(not(unix))]
    {
        let _ = bytes;
        true
    }
}

#[cfg(unix)]
fn exit_now(line: &[u8]) -> ! {
    // SAFETY: `write` reads `line.len()` initialised bytes of a live slice; `_exit` takes an
    // integer and does not return. Both are async-signal-safe and allocate nothing.
    unsafe {
        let _ = libc::write(2, line.as_ptr().cast(), line.len());
        libc::_exit(2)
    }
}

#[cfg(not(unix))]
fn exit_now(line: &[u8]) -> ! {
    use std::io::Write as _;
    let _ = std::io::stderr().write_all(line);
    std::process::exit(2)
}

/// A line formatted into a fixed buffer (what does not fit is cut).
struct StackLine {
    buf: [u8; 512],
    len: usize,
}

impl Default for StackLine {
    fn default() -> Self {
        Self {
            buf: [0; 512],
            len: 0,
        }
    }
}

impl StackLine {
    fn as_bytes(&self) -> &[u8] {
        &self.buf[..self.len]
    }
}

impl std::fmt::Write for StackLine {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        let n = s.len().min(self.buf.len() - self.len);
        self.buf[self.len..self.len + n].copy_from_slice(&s.as_bytes()[..n]);
        self.len += n;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fmt::Write as _;

    #[test]
    fn a_refusal_inside_fallible_is_returned_to_the_caller() {
        // Not the global allocator in unit tests, so this checks the flag's scoping: set inside,
        // restored after, also when `f` panics.
        assert!(!FALLIBLE.with(Cell::get));
        assert!(fallible(|| FALLIBLE.with(Cell::get)));
        assert!(!FALLIBLE.with(Cell::get));
        let _ = std::panic::catch_unwind(|| fallible(|| panic!("inside")));
        assert!(!FALLIBLE.with(Cell::get));
    }

    #[test]
    fn the_line_says_mib_only_from_one_mib() {
        let mut small = String::new();
        refusal_line(&mut small, 180).unwrap();
        assert!(small.contains("refused 180 bytes more"), "{small}");
        let mut large = String::new();
        refusal_line(&mut large, 100_663_296).unwrap();
        assert!(
            large.contains("refused 100663296 bytes (96.0 MiB) more"),
            "{large}"
        );
        assert_eq!(large.lines().count(), 1);
    }

    #[test]
    fn the_stack_line_cuts_what_does_not_fit() {
        let mut line = StackLine::default();
        write!(line, "{}", "x".repeat(600)).unwrap();
        assert_eq!(line.as_bytes().len(), 512);
    }
}
