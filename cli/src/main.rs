//! `oomguard`: replay allocation traces through oomguard's caching allocator.
//!
//! Exit status: 0 on success, 1 when a replay hit out-of-memory (or another allocation failure;
//! `plot` and `view` still write their picture), 2 on bad input (unreadable, malformed or hostile
//! file, bad size, bad configuration, bad arguments). A closed standard output (`| head`) ends
//! the command quietly with the status it would have had.

use std::fmt::Write as _;
use std::io::{IsTerminal, Write as _};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use oomguard_cli::device::DeviceSpec;
use oomguard_cli::gen::{generate, GenKind, GenSpec};
use oomguard_cli::mincap::{min_capacity_on, NoCapacity, Progress, MAX_CAPACITY};
use oomguard_cli::replay::{replay, ReplayOptions, ReplayReport};
use oomguard_cli::{detect, plot, Trace};
use oomguard_runtime::{AllocatorConfig, ByteSize};

// Host memory the machine refuses ends the command with one line and exit 2, not an abort.
#[global_allocator]
static ALLOCATOR: oomguard_cli::host_memory::ExitOnRefusal =
    oomguard_cli::host_memory::ExitOnRefusal;

/// Replay GPU allocation traces through oomguard's caching allocator: why did a program run out
/// of memory with memory free?
#[derive(Parser, Debug)]
#[command(name = "oomguard", version, about)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Replay a trace (CSV, PyTorch snapshot pickle or RMM log); exit 1 if it runs out of memory.
    Replay {
        /// The trace file (`-`: standard input).
        file: PathBuf,
        /// Allocator configuration (PyTorch syntax); default: `$OOMGUARD_ALLOC_CONF`, else none.
        #[arg(long, env = "OOMGUARD_ALLOC_CONF", default_value = "")]
        config: String,
        /// Simulated device capacity, e.g. "80GiB".
        #[arg(long, default_value = "80GiB")]
        capacity: String,
        /// Print one JSON object instead of a table.
        #[arg(long)]
        json: bool,
        /// The device: `sim` (simulated, address-only), `cuda:N` (a real GPU: the allocator's
        /// driver calls happen, no kernel runs; the capacity becomes a memory limit) or
        /// `sim-limit` (the simulated device run the way a GPU is).
        #[arg(long, default_value = "sim")]
        device: String,
        /// Page size of the simulated device's growable segments, e.g. "512KiB" (a power of two
        /// from 4 KiB to 1 GiB; default 2 MiB, an H100's): how much of peak reserved is page
        /// rounding. Not with `cuda:N`.
        #[arg(long)]
        page_size: Option<String>,
        /// The number of training steps in the trace: prints what each step mapped and
        /// unmapped (a settled loop: nothing). Steps are cut where the fewest bytes are live
        /// near each 1/N of the events, and each is marked as `train_step` marks a step (a step
        /// that moved pages is then served from a fixed layout).
        #[arg(long, value_parser = clap::value_parser!(u64).range(1..=100_000))]
        steps: Option<u64>,
        /// Replay each event on a thread of its own recorded thread (the CSV's `thread`
        /// column, an RMM log's Thread), one event at a time in trace order, so that the
        /// allocator runs in its multi-thread mode (thread caches) as the program did, e.g.
        /// libtorch's autograd engine freeing the forward's tensors on its own thread. Default:
        /// every event on one thread. At most 1024 threads.
        #[arg(long)]
        threads: bool,
    },
    /// Replay a trace under several configurations, side by side.
    Compare {
        /// The trace file (`-`: standard input).
        file: PathBuf,
        /// A configuration (repeat for each); default: expandable_segments False and True.
        #[arg(long = "config")]
        configs: Vec<String>,
        /// Simulated device capacity.
        #[arg(long, default_value = "80GiB")]
        capacity: String,
        /// Also search each configuration's smallest capacity (slower).
        #[arg(long)]
        mincap: bool,
        /// Print a JSON array instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Plot live and reserved bytes and the segments over a replay (self-contained SVG or HTML);
    /// exit 1 (after writing) if the replay runs out of memory.
    Plot {
        /// The trace file (`-`: standard input).
        file: PathBuf,
        /// Output file: .svg or .html.
        #[arg(short, long)]
        output: PathBuf,
        /// Allocator configuration (PyTorch syntax); default: `$OOMGUARD_ALLOC_CONF`, else none.
        #[arg(long, env = "OOMGUARD_ALLOC_CONF", default_value = "")]
        config: String,
        /// Simulated device capacity.
        #[arg(long, default_value = "80GiB")]
        capacity: String,
    },
    /// Write an interactive page (one self-contained HTML file): a zoomable timeline of live and
    /// reserved bytes, and the memory map at any moment and at each OOM; exit 1 (after writing)
    /// if the replay runs out of memory.
    View {
        /// The trace file (`-`: standard input).
        file: PathBuf,
        /// Output file: must end in .html (and not be the trace itself).
        #[arg(short, long)]
        output: PathBuf,
        /// Allocator configuration (PyTorch syntax); default: `$OOMGUARD_ALLOC_CONF`, else none.
        #[arg(long, env = "OOMGUARD_ALLOC_CONF", default_value = "")]
        config: String,
        /// Simulated device capacity.
        #[arg(long, default_value = "80GiB")]
        capacity: String,
    },
    /// Find the smallest device capacity on which the trace replays without out-of-memory, by
    /// bisection (one that fits with one failing just below it: replays are not monotone in the
    /// capacity, so a smaller one may fit too).
    Mincap {
        /// The trace file (`-`: standard input).
        file: PathBuf,
        /// Allocator configuration (PyTorch syntax); default: `$OOMGUARD_ALLOC_CONF`, else none.
        #[arg(long, env = "OOMGUARD_ALLOC_CONF", default_value = "")]
        config: String,
        /// Bisection tolerance, a fraction of the capacity.
        #[arg(long, default_value_t = 0.001)]
        tolerance: f64,
        /// Print one JSON object instead of text.
        #[arg(long)]
        json: bool,
        /// The device: `sim`, `cuda:N` (each replay under a memory limit on the GPU) or
        /// `sim-limit`.
        #[arg(long, default_value = "sim")]
        device: String,
    },
    /// Whether a loop of the trace's step can run with no page moved: the lowest static layout
    /// found for one step (each block at one offset for good; blocks live at the same time never
    /// overlap) against the step's peak live bytes and, if given, a capacity. A layout found
    /// under the capacity shows that a loop can settle there; none found proves nothing.
    Layout {
        /// The trace file (`-`: standard input).
        file: PathBuf,
        /// The number of training steps in the trace, cut as `replay --steps` cuts them: the
        /// last one is laid out (1: the whole trace).
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=100_000))]
        steps: u64,
        /// Block orders to try (fewer on a step of many blocks).
        #[arg(long, default_value_t = 300, value_parser = clap::value_parser!(u32).range(1..=100_000))]
        tries: u32,
        /// A capacity to compare the layout with, e.g. "78GiB".
        #[arg(long)]
        capacity: Option<String>,
        /// Print one JSON object instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Generate a seeded varying-shape trace in the CSV format.
    Gen {
        /// Workload.
        #[arg(value_enum)]
        kind: GenKind,
        /// Seed.
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Training steps or inference requests (default: the standard workload's; at most
        /// 100000, and as many as make 60 million events: about 41,000 inference requests).
        #[arg(long)]
        steps: Option<u32>,
        /// A tiny workload (for tests).
        #[arg(long)]
        tiny: bool,
        /// Output file (default, or `-`: standard output).
        #[arg(short, long)]
        output: Option<PathBuf>,
    },
}

/// A failure to report: the message, and the exit status.
struct Fail(String, u8);

fn input<E: std::fmt::Display>(e: E) -> Fail {
    Fail(e.to_string(), 2)
}

/// The most steps `gen` makes.
const MAX_GEN_STEPS: u32 = 100_000;

/// The most events `gen` makes (the trace is built in memory, about 60 bytes an event with its
/// text): a training step of the standard workload makes about 530, an inference request about
/// 1,440, so the step bound alone let `gen inference` build 144 million.
const MAX_GEN_EVENTS: usize = 60_000_000;

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            use clap::error::ErrorKind;
            if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion)
                || matches!(
                    e.kind(),
                    ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand
                )
            {
                let _ = e.print();
                return ExitCode::from(if e.use_stderr() { 2 } else { 0 });
            }
            // clap reads OOMGUARD_ALLOC_CONF as an argument and does not name it
            let env_not_utf8 =
                std::env::var_os("OOMGUARD_ALLOC_CONF").is_some_and(|v| v.to_str().is_none());
            if e.kind() == ErrorKind::InvalidUtf8 && env_not_utf8 {
                eprintln!(
                    "oomguard: OOMGUARD_ALLOC_CONF is not valid UTF-8 (an allocator configuration \
                     such as \"expandable_segments:True\"; unset it or fix it)"
                );
            } else {
                eprintln!(
                    "oomguard: {} (see `oomguard --help`)",
                    one_line(&clap_line(&e.to_string()))
                );
            }
            return ExitCode::from(2);
        }
    };
    let mut out = String::new();
    let result = run(cli.cmd, &mut out);
    let mut stdout = std::io::stdout().lock();
    match stdout
        .write_all(out.as_bytes())
        .and_then(|()| stdout.flush())
    {
        Ok(()) => {}
        // `oomguard gen training | head -2`: the reader has all it wants; exit quietly.
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {}
        Err(e) => {
            eprintln!("oomguard: standard output: {e}");
            return ExitCode::from(2);
        }
    }
    match result {
        Ok(code) => ExitCode::from(code),
        Err(Fail(msg, code)) => {
            eprintln!("oomguard: {}", one_line(&msg));
            ExitCode::from(code)
        }
    }
}

/// A message as the one line the command prints: newlines made spaces, and at most
/// [`MAX_LINE`] characters (an argument of megabytes, quoted back, made a line of megabytes).
fn one_line(msg: &str) -> String {
    let line = msg.replace('\n', " ");
    match line.char_indices().nth(MAX_LINE) {
        None => line,
        Some((end, _)) => format!("{}… (cut: {} bytes in all)", &line[..end], line.len()),
    }
}

/// Most characters of an error line (the longest the commands write is under 1,000).
const MAX_LINE: usize = 2_000;

/// clap's error as one line: its message and the arguments it names (a missing `<FILE>` is on
/// the line after "the following required arguments were not provided:"), without the usage.
fn clap_line(text: &str) -> String {
    let parts: Vec<&str> = text
        .lines()
        .map(str::trim)
        .take_while(|l| !l.starts_with("Usage:") && !l.starts_with("For more information"))
        .filter(|l| !l.is_empty())
        .collect();
    let line = parts.join(" ");
    let line = line.trim_start_matches("error: ");
    if line.is_empty() {
        "invalid arguments".to_string()
    } else {
        line.to_string()
    }
}

/// The allocator configuration of `--config`, or of `OOMGUARD_ALLOC_CONF` when the flag is not
/// given (as PyTorch reads `PYTORCH_CUDA_ALLOC_CONF`).
fn config(s: &str) -> Result<AllocatorConfig, Fail> {
    AllocatorConfig::parse(s)
        .map_err(|e| Fail(format!("--config (or OOMGUARD_ALLOC_CONF): {e}"), 2))
}

/// What `output` is to be written as (`html` or, where `svg` is allowed, `svg`), from its
/// extension; refused when the extension is neither, or when `output` is the trace `file`
/// itself (writing would destroy the input).
fn output_kind(file: &Path, output: &Path, svg: bool) -> Result<&'static str, Fail> {
    let ext = output
        .extension()
        .and_then(|e| e.to_str())
        .map(|e| e.to_ascii_lowercase());
    let kind = match ext.as_deref() {
        Some("html" | "htm") => "html",
        Some("svg") if svg => "svg",
        _ => {
            let allowed = if svg { ".svg or .html" } else { ".html" };
            return Err(Fail(
                format!("{}: the output must end in {allowed}", output.display()),
                2,
            ));
        }
    };
    if same_file(file, output) {
        return Err(Fail(
            format!(
                "{}: the output is the trace being read; write elsewhere",
                output.display()
            ),
            2,
        ));
    }
    Ok(kind)
}

/// Whether `a` and `b` are one file: the same path once resolved, or (a hard link) the same
/// device and inode.
fn same_file(a: &Path, b: &Path) -> bool {
    if let (Ok(a), Ok(b)) = (std::fs::canonicalize(a), std::fs::canonicalize(b)) {
        if a == b {
            return true;
        }
    }
    #[cfg(unix)]
    if let (Ok(a), Ok(b)) = (std::fs::metadata(a), std::fs::metadata(b)) {
        use std::os::unix::fs::MetadataExt;
        return (a.dev(), a.ino()) == (b.dev(), b.ino());
    }
    false
}

/// `--steps n`: refused when the trace cannot be cut into `n` steps (too few events).
fn check_steps(trace: &Trace, n: usize) -> Result<(), Fail> {
    let cut = oomguard_cli::replay::step_starts(trace, n).len();
    if n > 1 && cut < n {
        return Err(Fail(
            format!(
                "--steps {n}: the trace's {} events could be cut into {cut} step(s) only (each \
                 step has an event and ends where the fewest bytes are live near its share of \
                 the trace); ask for fewer steps",
                trace.events.len()
            ),
            2,
        ));
    }
    Ok(())
}

/// Writes a picture or page of a replay to `output` and says so, with the replay's figures.
fn write_page(output: &Path, body: &str, r: &ReplayReport) -> Result<(), Fail> {
    std::fs::write(output, body).map_err(|e| Fail(format!("{}: {e}", output.display()), 2))?;
    eprintln!(
        "wrote {} (peak reserved {}, ratio {:.4}, {} failed allocations)",
        output.display(),
        ByteSize(r.peak_reserved_bytes),
        r.ratio,
        r.failures.len()
    );
    Ok(())
}

fn capacity(s: &str) -> Result<u64, Fail> {
    let c: ByteSize = s.parse().map_err(|e| Fail(format!("--capacity: {e}"), 2))?;
    if c.0 == 0 {
        return Err(Fail("--capacity: must be more than 0 bytes".into(), 2));
    }
    if c.0 > MAX_CAPACITY {
        return Err(Fail(
            format!(
                "--capacity: {c} ({} bytes) is more than the {} ({MAX_CAPACITY} bytes) a \
                 replay goes up to",
                c.0,
                ByteSize(MAX_CAPACITY)
            ),
            2,
        ));
    }
    Ok(c.0)
}

fn device_spec(s: &str) -> Result<DeviceSpec, Fail> {
    s.parse()
        .map_err(|e: String| Fail(format!("--device: {e}"), 2))
}

/// Opens the replay's device once, so that a GPU that cannot be used (no driver, no such
/// device) is one line and exit 2 before anything is replayed.
fn probe(opts: &ReplayOptions) -> Result<(), Fail> {
    oomguard_cli::device::open(&opts.device, opts.capacity, &opts.config, opts.page_size)
        .map(drop)
        .map_err(|e| Fail(e, 2))
}

fn load(path: &Path) -> Result<Trace, Fail> {
    let name = if path == Path::new("-") {
        "standard input".to_string()
    } else {
        path.display().to_string()
    };
    detect::read_trace(path).map_err(|e| match e {
        oomguard_cli::ReadError::Io { source, .. } => Fail(format!("{name}: {source}"), 2),
        _ => Fail(format!("{name}: {e}"), 2),
    })
}

/// Replays with a progress bar on stderr when it is a terminal and the trace is long.
fn replay_with_progress(trace: &Trace, opts: &ReplayOptions) -> ReplayReport {
    let n = trace.events.len() as u64;
    if n >= 200_000 && std::io::stderr().is_terminal() {
        let bar = indicatif::ProgressBar::new(n);
        let (r, _) = replay(trace, opts, &mut |done| bar.set_position(done as u64));
        bar.finish_and_clear();
        r
    } else {
        replay(trace, opts, &mut |_| {}).0
    }
}

/// Appends a line to the command's standard output (written at the end, in one piece).
macro_rules! outln {
    ($o:expr, $($t:tt)*) => {{
        let _ = writeln!($o, $($t)*);
    }};
}

/// The capacity search, with a progress line on stderr once it has run for a second (when stderr
/// is a terminal). A trace too large to search is bad input (2); one that fails at every
/// capacity is a replay failure (1).
fn mincap_with_progress(
    trace: &Trace,
    cfg: &AllocatorConfig,
    device: &DeviceSpec,
    tolerance: f64,
) -> Result<oomguard_cli::mincap::MinCapacity, Fail> {
    let bar = indicatif::ProgressBar::hidden();
    bar.set_style(
        indicatif::ProgressStyle::with_template("{spinner} {elapsed} mincap: {msg}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_spinner()),
    );
    bar.set_message("replaying at the floor (peak live bytes)");
    if std::io::stderr().is_terminal() {
        // Shown only if the search is still running after a second: short ones stay silent.
        let late = bar.clone();
        std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_secs(1));
            if !late.is_finished() {
                late.set_draw_target(indicatif::ProgressDrawTarget::stderr());
                late.enable_steady_tick(std::time::Duration::from_millis(120));
            }
        });
    }
    let r = min_capacity_on(trace, cfg, device, tolerance, &mut |p: Progress| {
        bar.set_message(match p.hi {
            Some(hi) => format!(
                "{} replays, between {} and {}",
                p.replays,
                ByteSize(p.lo),
                ByteSize(hi)
            ),
            None => format!("{} replays, fails at {}", p.replays, ByteSize(p.lo)),
        });
    });
    bar.finish_and_clear();
    r.map_err(|e| match e {
        NoCapacity::TooLarge { .. } => Fail(e.to_string(), 2),
        NoCapacity::Fails { .. } => Fail(e.to_string(), 1),
    })
}

fn run(cmd: Cmd, out: &mut String) -> Result<u8, Fail> {
    match cmd {
        Cmd::Replay {
            file,
            config: c,
            capacity: cap,
            json,
            device,
            page_size,
            steps,
            threads,
        } => {
            let opts = ReplayOptions {
                steps: steps.map(|n| n as usize),
                threads,
                config: config(&c)?,
                capacity: capacity(&cap)?,
                device: device_spec(&device)?,
                page_size: page_size
                    .map(|p| p.parse::<ByteSize>().map(|b| b.0))
                    .transpose()
                    .map_err(|e| Fail(format!("--page-size: {e}"), 2))?,
                ..Default::default()
            };
            let trace = load(&file)?;
            probe(&opts)?;
            let named = oomguard_cli::threads::thread_count(&trace.events);
            if threads && named <= 1 {
                // on standard error: the replay's figures are those of a replay without it
                eprintln!(
                    "oomguard: note: --threads: the trace names at most one thread (every event \
                     of a trace without a thread column is on thread 0), so its events are \
                     replayed on one worker thread"
                );
            }
            if threads && named > oomguard_cli::threads::MAX_THREADS {
                return Err(Fail(
                    format!(
                        "--threads: the trace names {named} threads; at most {} are replayed on threads of their own",
                        oomguard_cli::threads::MAX_THREADS
                    ),
                    2,
                ));
            }
            if let Some(n) = opts.steps {
                check_steps(&trace, n)?;
            }
            let r = replay_with_progress(&trace, &opts);
            if let Some(why) = &r.stopped {
                // not the trace's doing, nor the allocator's: no figures to report
                return Err(Fail(
                    format!("{}: the replay could not go on at {why}", file.display()),
                    2,
                ));
            }
            if json {
                let mut v = serde_json::to_value(&r).map_err(input)?;
                if let Some(o) = v.as_object_mut() {
                    o.insert("file".into(), file.display().to_string().into());
                    o.insert("format".into(), trace.format.to_string().into());
                    o.insert("notes".into(), trace.notes.clone().into());
                }
                outln!(out, "{v}");
            } else {
                print_report(out, &file, &trace, &r);
            }
            Ok(if r.completed { 0 } else { 1 })
        }
        Cmd::Compare {
            file,
            configs,
            capacity: cap,
            mincap,
            json,
        } => {
            let configs = if configs.is_empty() {
                vec![
                    "expandable_segments:False".to_string(),
                    "expandable_segments:True".to_string(),
                ]
            } else {
                configs
            };
            let parsed: Vec<AllocatorConfig> = configs
                .iter()
                .map(|c| config(c))
                .collect::<Result<_, _>>()?;
            let cap = capacity(&cap)?;
            let trace = load(&file)?;
            let mut rows = Vec::new();
            for c in &parsed {
                let opts = ReplayOptions {
                    config: c.clone(),
                    capacity: cap,
                    ..Default::default()
                };
                let r = replay_with_progress(&trace, &opts);
                let m = if mincap {
                    Some(mincap_with_progress(&trace, c, &DeviceSpec::Sim, 0.001)?)
                } else {
                    None
                };
                rows.push((r, m));
            }
            if json {
                let arr: Vec<serde_json::Value> = rows
                    .iter()
                    .map(|(r, m)| {
                        let mut v = serde_json::to_value(r).unwrap_or_default();
                        if let (Some(o), Some(m)) = (v.as_object_mut(), m) {
                            o.insert("min_capacity_bytes".into(), m.min_capacity_bytes.into());
                            o.insert("min_capacity_ratio".into(), m.ratio.into());
                        }
                        v
                    })
                    .collect();
                outln!(out, "{}", serde_json::Value::from(arr));
            } else {
                outln!(
                    out,
                    "{} ({}, {} events, peak live {})",
                    file.display(),
                    trace.format,
                    trace.events.len(),
                    ByteSize(trace.peak_live_bytes())
                );
                outln!(
                    out,
                    "{:<40} {:>14} {:>8} {:>9} {:>7} {:>5} {:>8} {:>8} {:>7} {:>7} {:>8}",
                    "config",
                    "peak reserved",
                    "ratio",
                    "mincap/x",
                    "retries",
                    "ooms",
                    "seg+",
                    "seg-",
                    "map",
                    "unmap",
                    "seconds"
                );
                for (r, m) in &rows {
                    let mc = m
                        .as_ref()
                        .map(|m| format!("{:.4}", m.ratio))
                        .unwrap_or_else(|| "-".into());
                    let b = r.backend_calls;
                    outln!(
                        out,
                        "{:<40} {:>14} {:>8.4} {:>9} {:>7} {:>5} {:>8} {:>8} {:>7} {:>7} {:>8.3}",
                        r.config,
                        ByteSize(r.peak_reserved_bytes).to_string(),
                        r.ratio,
                        mc,
                        r.num_alloc_retries,
                        r.num_ooms,
                        b.alloc_segment,
                        b.free_segment,
                        b.map,
                        b.unmap,
                        r.seconds
                    );
                }
            }
            Ok(if rows.iter().all(|(r, _)| r.completed) {
                0
            } else {
                1
            })
        }
        Cmd::Plot {
            file,
            output,
            config: c,
            capacity: cap,
        } => {
            let html = output_kind(&file, &output, true)? == "html";
            let opts = ReplayOptions {
                config: config(&c)?,
                capacity: capacity(&cap)?,
                timeline: true,
                ..Default::default()
            };
            let trace = load(&file)?;
            let (r, tl) = replay(&trace, &opts, &mut |_| {});
            let tl = tl.unwrap_or_default();
            let title = file
                .file_name()
                .map(|f| f.to_string_lossy().to_string())
                .unwrap_or_default();
            let body = if html {
                plot::html(&title, &r, &tl)
            } else {
                plot::svg(&title, &r, &tl)
            };
            write_page(&output, &body, &r)?;
            // As `replay`: the picture is written either way, and the status says whether the
            // trace fits on this capacity.
            Ok(if r.completed { 0 } else { 1 })
        }
        Cmd::View {
            file,
            output,
            config: c,
            capacity: cap,
        } => {
            output_kind(&file, &output, false)?;
            let opts = ReplayOptions {
                config: config(&c)?,
                capacity: capacity(&cap)?,
                ..Default::default()
            };
            let trace = load(&file)?;
            let r = replay_with_progress(&trace, &opts);
            let data = oomguard_cli::viewdata::ViewData::record(&trace, &opts);
            let title = Some(file.as_os_str())
                .filter(|f| *f != "-")
                .and_then(|_| file.file_name())
                .map(|f| f.to_string_lossy().to_string())
                .unwrap_or_else(|| "standard input".into());
            let page = oomguard_cli::view::html(&title, &trace, &r, &data);
            write_page(&output, &page, &r)?;
            Ok(if r.completed { 0 } else { 1 })
        }
        Cmd::Mincap {
            file,
            config: c,
            tolerance,
            json,
            device,
        } => {
            let device = device_spec(&device)?;
            if !(tolerance > 0.0 && tolerance < 1.0) {
                return Err(Fail(
                    format!("--tolerance: {tolerance} is outside (0, 1)"),
                    2,
                ));
            }
            let cfg = config(&c)?;
            let trace = load(&file)?;
            probe(&ReplayOptions {
                config: cfg.clone(),
                device: device.clone(),
                ..Default::default()
            })?;
            let m = mincap_with_progress(&trace, &cfg, &device, tolerance)?;
            if json {
                outln!(out, "{}", serde_json::to_string(&m).map_err(input)?);
            } else {
                outln!(
                    out,
                    "{}: smallest capacity found {} ({} bytes), {:.4} x peak live {} ({} replays, {})",
                    file.display(),
                    ByteSize(m.min_capacity_bytes),
                    m.min_capacity_bytes,
                    m.ratio,
                    ByteSize(m.peak_live_bytes),
                    m.replays,
                    m.config
                );
            }
            Ok(0)
        }
        Cmd::Layout {
            file,
            steps,
            tries,
            capacity: cap,
            json,
        } => {
            let cap = cap.map(|c| capacity(&c)).transpose()?;
            let trace = load(&file)?;
            check_steps(&trace, steps as usize)?;
            let r = oomguard_cli::layout::layout(&trace, steps as usize, tries).map_err(input)?;
            // the layout is mapped in whole pages: those must fit
            let fits = cap.map(|c| r.layout_pages_bytes <= c);
            if json {
                let mut v = serde_json::to_value(&r).map_err(input)?;
                v["capacity_bytes"] = serde_json::json!(cap);
                v["fits"] = serde_json::json!(fits);
                outln!(out, "{v}");
            } else {
                outln!(out, "trace            {}", file.display());
                outln!(
                    out,
                    "step             events {}..{} of {} ({} blocks)",
                    r.first_event,
                    r.end_event,
                    trace.events.len(),
                    r.blocks
                );
                outln!(
                    out,
                    "peak live        {} ({} bytes; each block rounded up to 512 bytes, as \
                     the allocator rounds it)",
                    ByteSize(r.peak_live_bytes),
                    r.peak_live_bytes
                );
                outln!(
                    out,
                    "static layout    {} ({} bytes), {:.4} x peak live, after {} block orders; \
                     mapped in 2 MiB pages: {}",
                    ByteSize(r.layout_bytes),
                    r.layout_bytes,
                    r.layout_bytes as f64 / r.peak_live_bytes.max(1) as f64,
                    r.tries,
                    ByteSize(r.layout_pages_bytes)
                );
                if let (Some(c), Some(f)) = (cap, fits) {
                    let verdict = if f {
                        "a layout fits: a loop of this step can run with no page moved"
                    } else {
                        "no layout found under it (the search is not exhaustive)"
                    };
                    outln!(
                        out,
                        "capacity         {} ({c} bytes): {verdict}",
                        ByteSize(c)
                    );
                }
            }
            Ok(0)
        }
        Cmd::Gen {
            kind,
            seed,
            steps,
            tiny,
            output,
        } => {
            let mut spec = if tiny {
                GenSpec::tiny(kind, seed)
            } else {
                GenSpec::standard(kind, seed)
            };
            if let Some(s) = steps {
                // The trace is built in memory before it is written: bounded.
                if s > MAX_GEN_STEPS {
                    return Err(Fail(
                        format!(
                            "--steps {s}: at most {MAX_GEN_STEPS} (the trace is built in memory)"
                        ),
                        2,
                    ));
                }
                if s == 0 {
                    return Err(Fail("--steps 0: a trace has at least 1 step".into(), 2));
                }
                // events grow linearly in steps (after the first few): measured on 256
                let sample = GenSpec { steps: 256, ..spec };
                let per_step = generate(&sample).events.len().div_ceil(256).max(1);
                let most = (MAX_GEN_EVENTS / per_step).min(MAX_GEN_STEPS as usize);
                if s as usize > most {
                    return Err(Fail(
                        format!(
                            "--steps {s}: at most {most} for this workload (about {per_step} \
                             events a step; the trace is built in memory)"
                        ),
                        2,
                    ));
                }
                spec.steps = s;
            }
            let t = generate(&spec);
            let text = oomguard_cli::csv_trace::write(&t.events);
            // the events are not needed once written out: the text alone is held from here
            drop(t);
            match output.filter(|p| p.as_os_str() != "-") {
                Some(p) => std::fs::write(&p, text)
                    .map_err(|e| Fail(format!("{}: {e}", p.display()), 2))?,
                // (`-o -` is standard output, as for the trace readers' `-`)
                None if out.is_empty() => *out = text,
                None => out.push_str(&text),
            }
            Ok(0)
        }
    }
}

fn print_report(out: &mut String, file: &Path, trace: &Trace, r: &ReplayReport) {
    let b = r.backend_calls;
    outln!(
        out,
        "trace            {} ({}, {} events)",
        file.display(),
        trace.format,
        trace.events.len()
    );
    for n in &trace.notes {
        outln!(out, "note             {n}");
    }
    outln!(out, "device           {}", r.device);
    outln!(out, "config           {}", r.config);
    outln!(out, "capacity         {}", ByteSize(r.capacity_bytes));
    outln!(
        out,
        "threads          {} called the allocator, {} allocated{}",
        r.threads,
        r.allocating_threads,
        if r.allocating_threads > 1 {
            " (multi-thread mode: thread caches)"
        } else {
            ""
        }
    );
    // with failed allocations the replay's peak is of those served, not the trace's
    let of_trace = if r.failures.is_empty() {
        String::new()
    } else {
        let t = trace.peak_live_bytes();
        format!(
            " of the allocations served; the trace's own: {} ({t} bytes)",
            ByteSize(t)
        )
    };
    outln!(
        out,
        "peak live        {} ({} bytes){of_trace}",
        ByteSize(r.peak_live_bytes),
        r.peak_live_bytes
    );
    outln!(
        out,
        "peak reserved    {} ({} bytes)",
        ByteSize(r.peak_reserved_bytes),
        r.peak_reserved_bytes
    );
    outln!(
        out,
        "ratio            {:.4} (peak reserved / peak live)",
        r.ratio
    );
    outln!(out, "alloc retries    {}", r.num_alloc_retries);
    outln!(out, "out-of-memory    {}", r.num_ooms);
    outln!(
                out,
        "backend calls    alloc_segment {}, free_segment {}, map {}, unmap {}, reserve {}, release {}",
        b.alloc_segment, b.free_segment, b.map, b.unmap, b.reserve, b.release
    );
    outln!(
        out,
        "remapped         {} mapped, {} unmapped, {} device synchronisations, {} stream synchronisations",
        ByteSize(b.mapped_bytes),
        ByteSize(b.unmapped_bytes),
        b.synchronize,
        b.stream_synchronize
    );
    for (k, m) in r.per_step.iter().enumerate() {
        outln!(
            out,
            "step {k:<11} from event {}: {} mapped in {} calls, {} unmapped in {} calls, {} synchronisations, {} alloc retries",
            m.first_event,
            ByteSize(m.mapped_bytes),
            m.maps,
            ByteSize(m.unmapped_bytes),
            m.unmaps,
            m.synchronizations,
            m.retries
        );
    }
    outln!(out, "seconds          {:.3}", r.seconds);
    for f in r.failures.iter().take(5) {
        outln!(
            out,
            "failed           event {} (id {}, {}): {}",
            f.index,
            f.id,
            ByteSize(f.bytes),
            f.message
        );
    }
    if r.failures.len() > 5 {
        outln!(out, "failed           … and {} more", r.failures.len() - 5);
    }
}
