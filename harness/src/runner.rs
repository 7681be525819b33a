//! The run: the phases named on the command line in order, each ended by its `PHASE` line, the
//! cache emptied between them, and the exit status.

use std::panic::{self, AssertUnwindSafe};
use std::process::ExitCode;
use std::time::Instant;

use crate::args::Args;
use crate::bench::Bench;
use crate::report::{one_line, Line};

/// The phases written here; an example's own phases are handed to its callback.
pub const GENERIC_PHASES: [&str; 6] = ["plain", "max", "equiv", "finder", "oom", "overhead"];

/// How a phase that ran ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Its checks held.
    Pass,
    /// A check failed (said in the lines above).
    Fail,
}

/// A phase's result: an error is a phase that could not run to its end.
pub type PhaseResult = Result<Outcome, String>;

/// Where the lines go.
#[derive(Debug)]
pub enum Sink {
    /// Printed on stdout.
    Stdout,
    /// Kept (the tests read them).
    Capture(Vec<String>),
}

/// The run's output: the lines' format and where they go (apart from the bench, so that a
/// phase can print while the bench is borrowed).
#[derive(Debug)]
pub struct Out {
    /// `--json`: one JSON object per line.
    pub json: bool,
    /// Where the lines go.
    pub sink: Sink,
}

impl Out {
    /// Prints a line in the run's format.
    pub fn emit(&mut self, line: Line) {
        let text = line.render(self.json);
        self.print(text);
    }

    /// Prints free text (a report's `Display`).
    pub fn print(&mut self, text: String) {
        match &mut self.sink {
            Sink::Stdout => crate::say!("{text}"),
            Sink::Capture(lines) => lines.extend(text.lines().map(str::to_string)),
        }
    }
}

/// A framework's bench, the run's options, and what the phases learnt so far.
pub struct Runner<B: Bench> {
    /// The framework's side.
    pub bench: B,
    /// The command line.
    pub args: Args,
    /// The largest batch of a plain step: `--max`, or measured by `max` in this run.
    pub max: Option<i64>,
    /// The lines.
    pub out: Out,
}

impl<B: Bench> Runner<B> {
    /// A run printing on stdout; `max` starts as `--max`.
    pub fn new(bench: B, args: Args) -> Self {
        Self {
            max: args.max,
            out: Out {
                json: args.json,
                sink: Sink::Stdout,
            },
            bench,
            args,
        }
    }

    /// Prints a line in the run's format (`--json` or text).
    pub fn emit(&mut self, line: Line) {
        self.out.emit(line);
    }

    /// Prints free text (a report's `Display`).
    pub fn print(&mut self, text: String) {
        self.out.print(text);
    }

    /// Runs one generic phase; `None` when `name` is not one ([`GENERIC_PHASES`]).
    pub fn generic_phase(&mut self, name: &str) -> Option<PhaseResult> {
        Some(match name {
            "plain" => self.plain(),
            "max" => self.max_phase(),
            "equiv" => self.equiv(),
            "finder" => self.finder(),
            "oom" => self.oom(),
            "overhead" => self.overhead(),
            _ => return None,
        })
    }

    /// Runs every phase of `--phase` in order: each through `own` first (the example's phases,
    /// or its wrapping of a generic one; `None` for a name it leaves to the harness), then the
    /// generic ones here. Each phase ends with a
    /// `PHASE phase=NAME status=ok|FAIL|error|panicked secs=.. total_secs=..` line; the next
    /// starts from an emptied cache. The exit status is 0 when every phase ran and its checks
    /// held, 1 otherwise.
    pub fn run(&mut self, mut own: impl FnMut(&mut Self, &str) -> Option<PhaseResult>) -> ExitCode {
        let started = Instant::now();
        let mut failed = false;
        for name in self.args.phases.clone() {
            let t = Instant::now();
            let out = panic::catch_unwind(AssertUnwindSafe(|| match own(self, &name) {
                Some(r) => r,
                None => self
                    .generic_phase(&name)
                    .unwrap_or_else(|| Err(format!("unknown phase {name}"))),
            }));
            let (status, error) = match out {
                Ok(Ok(Outcome::Pass)) => ("ok", None),
                Ok(Ok(Outcome::Fail)) => ("FAIL", None),
                Ok(Err(e)) => ("error", Some(e)),
                Err(p) => (
                    "panicked",
                    Some(
                        oomguard_runtime::retry::advanced::panic_text(p.as_ref())
                            .unwrap_or_default()
                            .to_owned(),
                    ),
                ),
            };
            failed |= status != "ok";
            // The next phase starts from an emptied cache (what this one held is dropped).
            if let Err(e) = self.bench.source().empty_cache() {
                self.emit(Line::phase(&name).text("empty_cache_error", one_line(&e.to_string())));
                failed = true;
            }
            let mut line = Line::phase(&name).text("status", status);
            if let Some(e) = error {
                line = line.text("error", one_line(&e));
            }
            self.emit(line.float("secs", t.elapsed().as_secs_f64(), 1).float(
                "total_secs",
                started.elapsed().as_secs_f64(),
                1,
            ));
        }
        if failed {
            ExitCode::FAILURE
        } else {
            ExitCode::SUCCESS
        }
    }

    /// `--max`, the `max` phase's, or measured now.
    pub fn known_max(&mut self) -> Result<i64, String> {
        if let Some(m) = self.max {
            return Ok(m);
        }
        self.max_phase()?;
        self.max
            .ok_or_else(|| "the max phase measured nothing".into())
    }
}
