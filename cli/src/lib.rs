//! The library behind the `oomguard` command: trace readers, replay through oomguard's caching
//! allocator, capacity search, plots and trace generators.
//!
//! "Why did I run out of memory with memory free?" — replay the program's allocations through the
//! allocator on a simulated device and look at reserved versus live bytes:
//!
//! ```
//! use oomguard_cli::{detect, replay::{replay, ReplayOptions}};
//! let csv = b"op,id,bytes,stream\na,0,1000000,0\na,1,3000000,0\nf,0,1000000,0\n";
//! let trace = detect::parse(csv, None).unwrap();
//! let (report, _) = replay(&trace, &ReplayOptions::default(), &mut |_| {});
//! assert_eq!(report.peak_live_bytes, 4_000_000);
//! assert!(report.ratio >= 1.0);
//! ```
//!
//! Readers: [`csv_trace`] (`op,id,bytes,stream`), [`snapshot`] (PyTorch memory snapshot pickles,
//! decoded by the small [`pickle`] VM), [`rmm`] (RMM logs); [`detect`] picks one from the content.

pub mod counting;
pub mod csv_trace;
pub mod detect;
pub mod device;
mod error;
mod event;
pub mod gen;
pub mod host_memory;
pub mod layout;
mod lines;
pub mod mincap;
pub mod pickle;
pub mod plot;
pub mod replay;
pub mod rmm;
pub mod snapshot;
pub mod threads;
pub mod view;
pub mod viewdata;

pub use error::ReadError;
pub use event::{Event, Op, Trace, TraceFormat};
