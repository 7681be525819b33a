//! The measuring phases of the GPT examples (tch_gpt, candle_gpt, burn_gpt), written once: the
//! command line ([`args`]), the output lines ([`report`]), and the phases (`plain`, `max`,
//! `finder`, `oom`, `overhead`, `equiv`) over a framework adapter ([`Bench`]) that makes models,
//! batches and steps. An example keeps what only its framework has (its model, its gradient check, its
//! allocator comparison) and hands the rest to [`Runner::run`]. [`checks`] holds the scenarios
//! the framework crates' tests share, [`GptShape`] the model shape of tch_gpt and candle_gpt.
//!
//! Not published: a workspace tool for the examples and their GPU runs (`scripts/gpu-runs/`).

pub mod args;
mod bench;
pub mod checks;
pub mod gpt_shape;
mod phase_equiv;
mod phase_finder;
mod phase_max;
mod phase_oom;
mod phase_overhead;
mod phase_plain;
pub mod report;
mod runner;

pub use args::{from_env, parse, Args, DeviceArg, NoOptions, Parsed, Spec};
pub use bench::{attempts_str, plan_str, Bench, Optim};
pub use gpt_shape::GptShape;
pub use report::{median, one_line, Line};
pub use runner::{Out, Outcome, PhaseResult, Runner, Sink, GENERIC_PHASES};
