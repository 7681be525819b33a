//! Allocator configuration, in PyTorch's `PYTORCH_CUDA_ALLOC_CONF` syntax.
//!
//! `expandable_segments:True,max_split_size_mb:128,roundup_power2_divisions:[256:1,>:4]`, from the
//! `OOMGUARD_ALLOC_CONF` environment variable ([`AllocatorConfig::from_env`]) or from code
//! ([`AllocatorConfig::parse`]). Bad input gives a [`ConfigError`] naming the key.

use std::fmt;
use std::str::FromStr;

/// The environment variable read by [`AllocatorConfig::from_env`].
pub const ENV_VAR: &str = "OOMGUARD_ALLOC_CONF";

/// The keys [`AllocatorConfig::parse`] accepts.
pub const VALID_KEYS: &[&str] = &[
    "backend",
    "expandable_segments",
    "max_split_size_mb",
    "roundup_power2_divisions",
    "garbage_collection_threshold",
    "per_process_memory_fraction",
    "max_non_split_rounding_mb",
    "page_recycle_threshold",
    "step_plans",
];

/// Keys PyTorch's CUDA allocator accepts that have no effect here: accepted (their value
/// checked) with a one-line warning, so an existing `PYTORCH_CUDA_ALLOC_CONF` value works.
/// `true`: the value is True/False; `false`: a whole number.
pub const IGNORED_KEYS: &[(&str, bool)] = &[
    ("release_lock_on_cudamalloc", true),
    ("release_lock_on_hipmalloc", true),
    ("pinned_use_cuda_host_register", true),
    ("pinned_use_hip_host_register", true),
    ("pinned_num_register_threads", false),
    ("pinned_reserve_segment_size_mb", false),
    ("pinned_use_background_threads", true),
    ("graph_capture_record_stream_reuse", true),
    ("pinned_free_catch_all", true),
    ("throw_on_cudamalloc_oom", true),
];

/// Number of power-of-two size intervals (from 1 MiB up) that `roundup_power2_divisions` sets.
pub const ROUNDUP_INTERVALS: usize = 16;

/// An invalid configuration string: which key, what is wrong, and the valid keys.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfigError {
    /// The key the problem is at, if one was recognised.
    pub key: Option<String>,
    /// What is wrong.
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // a hostile key or value of megabytes must not become a megabyte-long message
        let message = clipped(&self.message, 300);
        match &self.key {
            Some(k) => write!(
                f,
                "invalid allocator config at `{}`: {message}",
                clipped(k, 60)
            )?,
            None => write!(f, "invalid allocator config: {message}")?,
        }
        write!(f, " (valid keys: {})", VALID_KEYS.join(", "))
    }
}

/// `s`, or its first `max` characters and how long it was.
fn clipped(s: &str, max: usize) -> std::borrow::Cow<'_, str> {
    match s.char_indices().nth(max) {
        None => s.into(),
        Some((end, _)) => format!("{}… ({} bytes)", &s[..end], s.len()).into(),
    }
}

impl std::error::Error for ConfigError {}

/// How the caching allocator behaves. `Default` is the configuration that fragments least.
///
/// ```
/// use oomguard_runtime::AllocatorConfig;
/// let c = AllocatorConfig::parse("expandable_segments:False,max_split_size_mb:256").unwrap();
/// assert!(!c.expandable_segments);
/// assert_eq!(c.max_split_size, 256 << 20);
/// let e = AllocatorConfig::parse("expandible_segments:True").unwrap_err();
/// assert!(e.to_string().contains("unknown key"));
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct AllocatorConfig {
    /// Growable segments: one virtual address range per pool and stream, physical pages mapped on
    /// demand and unmapped when free. Needs a backend that supports them; otherwise ignored.
    pub expandable_segments: bool,
    /// Blocks of this size or more are never split (`u64::MAX`: no limit).
    pub max_split_size: u64,
    /// Divisions per power-of-two interval for rounding request sizes, interval `i` covering
    /// `[2^i MiB, 2^(i+1) MiB)` (the first also covers everything smaller). 0 or 1: plain 512-byte
    /// rounding.
    pub roundup_power2_divisions: [u64; ROUNDUP_INTERVALS],
    /// Fraction of the device's capacity above which cached free memory is released before the
    /// device is asked for more.
    pub garbage_collection_threshold: Option<f64>,
    /// `backend:cudaMallocAsync` (PyTorch's name): no caching here; every allocation goes to the
    /// device (on CUDA, its stream-ordered memory pool) and every free straight back. A baseline
    /// to measure the cache against; `native` (the default) is the caching allocator.
    pub pass_through: bool,
    /// Cap on the memory the allocator may hold, as a fraction of the device's capacity
    /// (PyTorch's `per_process_memory_fraction` key; `set_per_process_memory_fraction` at run
    /// time is [`crate::Device::set_memory_fraction`]). `None`: no cap; the key's value 0 means
    /// no cap, as in PyTorch.
    pub per_process_memory_fraction: Option<f64>,
    /// An oversize request (at least `max_split_size`) may take a free oversize block up to
    /// this many bytes larger than itself (PyTorch's `max_non_split_rounding_mb`; default and
    /// minimum 20 MiB).
    pub max_non_split_rounding: u64,
    /// Growable segments: the share of the memory limit (the device's capacity without one)
    /// up to which they map new pages for a request rather than move free pages from holes
    /// (oomguard's key `page_recycle_threshold`, in [0, 1]). `None` (the default) is 1: pages
    /// move only under pressure (a map that would pass the limit, or that the device refuses),
    /// so a loop that repeats settles and its steps make no driver call, and reserved memory
    /// may exceed live memory while the card has room, as PyTorch's expandable segments do.
    /// Lower values keep reserved memory closer to live memory by moving pages sooner (past
    /// the higher of that share and the high-water mark of reserved memory); `0` moves them
    /// before reserved memory passes its high-water mark (the tight mode). Figures
    /// (docs/BENCHMARKS.md, "One default allocator"): without a memory limit, peak reserved /
    /// peak live on the recorded traces resnet50 / gpt2 / vit_b16 / bert_infer is 1.0165 /
    /// 1.0875 / 1.0194 / 1.2890 by default and 1.003 / 1.013 / 1.005 / 1.022 with 0 (`oomguard
    /// replay`, 2026-11-29), while the smallest capacity `mincap` finds for them is 1.003–1.020 ×
    /// peak live either way (bert_infer 1.0192 by default, 1.0196 with 0); on an H100, candle's
    /// GPT-2 loop maps no page after its first step by default (0.995–0.997 × the driver pool's
    /// step time, GPU.md runs 26–27), where the former default, like 0, moved 5–10 GiB of pages
    /// per step and took 1.4–1.6 × the pool's time (runs 12, 17). By default a map backs each
    /// whole 20 MiB of it with one physical handle, as PyTorch's expandable segments do, and a
    /// free run gives back only whole handles; with a value set, every page is its own handle,
    /// so that reserved memory can follow live memory page by page.
    pub page_recycle_threshold: Option<f64>,
    /// Growable segments with marked steps ([`crate::CachingAllocator::mark_step`]): a step
    /// that moved pages and repeated the step before it is laid out once and served from one
    /// fixed range (oomguard's key `step_plans`, default True). False: marks are counted and
    /// nothing else changes.
    pub step_plans: bool,
}

impl Default for AllocatorConfig {
    fn default() -> Self {
        Self {
            expandable_segments: true,
            max_split_size: u64::MAX,
            roundup_power2_divisions: [0; ROUNDUP_INTERVALS],
            garbage_collection_threshold: None,
            pass_through: false,
            per_process_memory_fraction: None,
            max_non_split_rounding: 20 << 20,
            page_recycle_threshold: None,
            step_plans: true,
        }
    }
}

impl AllocatorConfig {
    /// PyTorch's native allocator: fixed segments, no growable ones.
    pub fn native() -> Self {
        Self {
            expandable_segments: false,
            ..Self::default()
        }
    }

    /// Whether this configuration is one [`AllocatorConfig::parse`] can make: every field in
    /// the range its key takes (fractions in their ranges and not NaN, `max_split_size` and
    /// `max_non_split_rounding` whole MiB of at least 20), so that what it prints
    /// ([`Display`](fmt::Display), which summaries and snapshots show) is what is in force. A
    /// configuration built by setting fields needs this; one from `parse` always passes.
    ///
    /// ```
    /// use oomguard_runtime::AllocatorConfig;
    /// let mut c = AllocatorConfig::default();
    /// c.per_process_memory_fraction = Some(f64::NAN);
    /// assert!(c.check().unwrap_err().to_string().contains("per_process_memory_fraction"));
    /// c.per_process_memory_fraction = Some(0.5);
    /// c.max_split_size = 3 << 20;
    /// assert!(c.check().unwrap_err().to_string().contains("max_split_size_mb"));
    /// c.max_split_size = 64 << 20;
    /// assert!(c.check().is_ok());
    /// ```
    pub fn check(&self) -> Result<(), ConfigError> {
        let text = self.to_string();
        let (back, _) = Self::parse_with_warnings(&text)?;
        if back == *self {
            return Ok(());
        }
        Err(ConfigError {
            key: None,
            message: format!(
                "a field holds a value its key cannot say (sizes are whole MiB; a memory \
                 fraction of 0 is None): it prints as `{text}`, which means another \
                 configuration"
            ),
        })
    }

    /// Reads [`ENV_VAR`]; the default when it is unset or empty.
    pub fn from_env() -> Result<Self, ConfigError> {
        match std::env::var(ENV_VAR) {
            Ok(s) => Self::parse(&s),
            Err(std::env::VarError::NotPresent) => Ok(Self::default()),
            Err(std::env::VarError::NotUnicode(_)) => Err(ConfigError {
                key: None,
                message: "not valid UTF-8".to_string(),
            }),
        }
        .map_err(|mut e| {
            // say where the bad value came from
            e.message = format!("{} (from {ENV_VAR})", e.message);
            e
        })
    }

    /// Parses a configuration string, starting from the default. Later keys override earlier ones.
    /// Keys of PyTorch's that have no effect here ([`IGNORED_KEYS`]) are accepted with a warning
    /// logged through `tracing`, and printed on standard error (the first time in the process)
    /// when no `tracing` subscriber is installed ([`AllocatorConfig::parse_with_warnings`]
    /// returns them instead).
    pub fn parse(s: &str) -> Result<Self, ConfigError> {
        let (c, warnings) = Self::parse_with_warnings(s)?;
        for w in &warnings {
            tracing::warn!("{w}");
        }
        if !warnings.is_empty() {
            static SAID: std::sync::Once = std::sync::Once::new();
            say_once_without_subscriber(&SAID, "warning", || warnings.join("; "));
        }
        Ok(c)
    }

    /// [`AllocatorConfig::parse`], returning the warnings (one line each) instead of logging them.
    pub fn parse_with_warnings(s: &str) -> Result<(Self, Vec<String>), ConfigError> {
        let mut c = Self::default();
        let mut warnings = Vec::new();
        for (key, value) in split_pairs(s)? {
            let err = |message: String| ConfigError {
                key: Some(key.to_string()),
                message,
            };
            match key {
                "backend" => {
                    c.pass_through = match value {
                        "native" => false,
                        "cudaMallocAsync" => true,
                        _ => {
                            return Err(err(format!(
                                "{value:?} is not a backend; use native or cudaMallocAsync"
                            )))
                        }
                    }
                }
                "expandable_segments" => c.expandable_segments = parse_bool(value).map_err(err)?,
                "step_plans" => c.step_plans = parse_bool(value).map_err(err)?,
                "max_split_size_mb" => {
                    let mb: u64 = value
                        .parse()
                        .map_err(|_| err(format!("{value:?} is not a whole number of MiB")))?;
                    // As PyTorch: below 20 MiB would split the 20 MiB segments of the large pool.
                    if mb < 20 {
                        return Err(err(format!("{mb} MiB is below the minimum of 20 MiB")));
                    }
                    c.max_split_size = mb
                        .checked_mul(1 << 20)
                        .ok_or_else(|| err(format!("{mb} MiB is too large")))?;
                }
                "roundup_power2_divisions" => {
                    c.roundup_power2_divisions = parse_divisions(value).map_err(err)?
                }
                "garbage_collection_threshold" => {
                    let t = parse_fraction(value, |t| t > 0.0 && t < 1.0, "(0, 1)").map_err(err)?;
                    c.garbage_collection_threshold = Some(t);
                }
                "per_process_memory_fraction" => {
                    let t = parse_fraction(value, |t| (0.0..=1.0).contains(&t), "[0, 1]")
                        .map_err(err)?;
                    // 0: no limit, as PyTorch reads the key
                    c.per_process_memory_fraction = (t > 0.0).then_some(t);
                }
                "max_non_split_rounding_mb" => {
                    let mb: u64 = value
                        .parse()
                        .map_err(|_| err(format!("{value:?} is not a whole number of MiB")))?;
                    if mb < 20 {
                        return Err(err(format!("{mb} MiB is below the minimum of 20 MiB")));
                    }
                    c.max_non_split_rounding = mb
                        .checked_mul(1 << 20)
                        .ok_or_else(|| err(format!("{mb} MiB is too large")))?;
                }
                "page_recycle_threshold" => {
                    let t = parse_fraction(value, |t| (0.0..=1.0).contains(&t), "[0, 1]")
                        .map_err(err)?;
                    c.page_recycle_threshold = Some(t);
                }
                other if IGNORED_KEYS.iter().any(|&(k, _)| k == other) => {
                    let boolean = IGNORED_KEYS.iter().any(|&(k, b)| k == other && b);
                    if boolean {
                        parse_bool(value).map_err(err)?;
                    } else {
                        let n = value
                            .parse::<u64>()
                            .map_err(|_| err(format!("{value:?} is not a whole number")))?;
                        if other == "pinned_num_register_threads" {
                            check_register_threads(n).map_err(err)?;
                        }
                    }
                    warnings.push(format!(
                        "allocator config key `{other}` is PyTorch's and has no effect in oomguard; \
                         ignored"
                    ));
                }
                other => {
                    return Err(ConfigError {
                        key: Some(other.to_string()),
                        message: format!("unknown key `{other}`"),
                    })
                }
            }
        }
        Ok((c, warnings))
    }

    /// The divisions that apply to a request of `size` bytes.
    #[inline]
    pub(crate) fn divisions_for(&self, size: u64) -> u64 {
        let log = 63 - size.max(1).leading_zeros() as usize;
        let idx = log.saturating_sub(20).min(ROUNDUP_INTERVALS - 1);
        self.roundup_power2_divisions[idx]
    }
}

impl FromStr for AllocatorConfig {
    type Err = ConfigError;
    fn from_str(s: &str) -> Result<Self, ConfigError> {
        Self::parse(s)
    }
}

impl fmt::Display for AllocatorConfig {
    /// Prints the configuration in the syntax [`AllocatorConfig::parse`] reads.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let b = |v: bool| if v { "True" } else { "False" };
        write!(f, "expandable_segments:{}", b(self.expandable_segments))?;
        if self.max_split_size != u64::MAX {
            write!(f, ",max_split_size_mb:{}", self.max_split_size >> 20)?;
        }
        if self.roundup_power2_divisions.iter().any(|&d| d > 1) {
            write!(f, ",roundup_power2_divisions:[")?;
            for (i, d) in self.roundup_power2_divisions.iter().enumerate() {
                let d = (*d).max(1);
                let sep = if i + 1 == ROUNDUP_INTERVALS { "" } else { "," };
                if i + 1 == ROUNDUP_INTERVALS {
                    write!(f, ">:{d}{sep}")?;
                } else {
                    write!(f, "{}:{d}{sep}", 1u64 << i)?;
                }
            }
            write!(f, "]")?;
        }
        if let Some(t) = self.garbage_collection_threshold {
            write!(f, ",garbage_collection_threshold:{t}")?;
        }
        if self.pass_through {
            write!(f, ",backend:cudaMallocAsync")?;
        }
        if let Some(t) = self.per_process_memory_fraction {
            write!(f, ",per_process_memory_fraction:{t}")?;
        }
        if self.max_non_split_rounding != 20 << 20 {
            write!(
                f,
                ",max_non_split_rounding_mb:{}",
                self.max_non_split_rounding >> 20
            )?;
        }
        if let Some(t) = self.page_recycle_threshold {
            write!(f, ",page_recycle_threshold:{t}")?;
        }
        if !self.step_plans {
            write!(f, ",step_plans:False")?;
        }
        Ok(())
    }
}

/// Never silent: without a `tracing` subscriber (with one, the caller's `tracing` event says
/// it), `text` on standard error as `oomguard LEVEL: TEXT`, once in the process for `said` (a
/// configuration read at every device would repeat it otherwise).
pub(crate) fn say_once_without_subscriber(
    said: &'static std::sync::Once,
    level: &str,
    text: impl FnOnce() -> String,
) {
    if !tracing::dispatcher::has_been_set() {
        said.call_once(|| eprintln!("oomguard {level}: {}", text()));
    }
}

/// A number within `range` (`in_range` decides; NaN never is).
fn parse_fraction(value: &str, in_range: impl Fn(f64) -> bool, range: &str) -> Result<f64, String> {
    let t: f64 = value
        .parse()
        .map_err(|_| format!("{value:?} is not a number"))?;
    if in_range(t) {
        Ok(t)
    } else {
        Err(format!("{t} is outside {range}"))
    }
}

/// Splits `k:v,k:[a:b,c:d],...` into pairs, keeping bracketed lists whole.
fn split_pairs(s: &str) -> Result<Vec<(&str, &str)>, ConfigError> {
    let mut out = Vec::new();
    let mut depth = 0i32;
    let mut start = 0;
    let bytes = s.as_bytes();
    for i in 0..=bytes.len() {
        let c = bytes.get(i).copied();
        match c {
            Some(b'[') => depth += 1,
            Some(b']') => {
                depth -= 1;
                if depth < 0 {
                    return Err(ConfigError {
                        key: None,
                        message: format!("unbalanced `]` at offset {i}"),
                    });
                }
            }
            Some(b',') | None if depth == 0 => {
                let item = s[start..i].trim();
                start = i + 1;
                if item.is_empty() {
                    continue;
                }
                let (k, v) = item.split_once(':').ok_or_else(|| ConfigError {
                    key: Some(item.to_string()),
                    message: format!("`{item}` has no value; write key:value"),
                })?;
                out.push((k.trim(), v.trim()));
            }
            None => {
                return Err(ConfigError {
                    key: None,
                    message: "unclosed `[`".to_string(),
                })
            }
            _ => {}
        }
    }
    Ok(out)
}

/// Most threads PyTorch's `pinned_num_register_threads` accepts.
const MAX_REGISTER_THREADS: u64 = 128;

/// PyTorch's rule for `pinned_num_register_threads`: a power of two, at most 128.
fn check_register_threads(n: u64) -> Result<(), String> {
    if !n.is_power_of_two() {
        return Err(format!(
            "{n} threads: the number of register threads has to be a power of 2"
        ));
    }
    if n > MAX_REGISTER_THREADS {
        return Err(format!(
            "{n} threads: the number of register threads must be at most {MAX_REGISTER_THREADS}"
        ));
    }
    Ok(())
}

fn parse_bool(v: &str) -> Result<bool, String> {
    match v.to_ascii_lowercase().as_str() {
        "true" | "1" => Ok(true),
        "false" | "0" => Ok(false),
        _ => Err(format!("{v:?} is not True or False")),
    }
}

fn parse_pow2(v: &str, what: &str) -> Result<u64, String> {
    let n: u64 = v
        .trim()
        .parse()
        .map_err(|_| format!("{v:?} is not a whole number"))?;
    if !n.is_power_of_two() {
        return Err(format!("{what} {n} is not a power of two"));
    }
    Ok(n)
}

/// `4` (every interval) or `[256:1,512:2,>:8]` (MiB interval starts : divisions), exactly as
/// PyTorch's `parseRoundUpPower2Divisions`: in a list a division count is 0 (plain rounding for
/// that interval) or a power of two; an interval start is a power of two, clamped to the last
/// interval; the first entry also fills the intervals before it; `>` fills every interval after
/// the last one given (from the second when it comes first); entries may come in any order, a
/// later one overriding. A bare value must be a power of two. 1 division (plain rounding) is
/// stored as 0.
fn parse_divisions(v: &str) -> Result<[u64; ROUNDUP_INTERVALS], String> {
    let mut d = [0u64; ROUNDUP_INTERVALS];
    let plain = |n: u64| if n == 1 { 0 } else { n };
    let Some(inner) = v.strip_prefix('[') else {
        let n = parse_pow2(v, "divisions")?;
        d.fill(plain(n));
        return Ok(d);
    };
    let inner = inner
        .strip_suffix(']')
        .ok_or_else(|| "list must end with `]`".to_string())?;
    let mut last = 0usize;
    let mut first = true;
    for item in inner.split(',').map(str::trim).filter(|i| !i.is_empty()) {
        let (k, n) = item
            .split_once(':')
            .ok_or_else(|| format!("`{item}` is not interval:divisions"))?;
        let n: u64 = n
            .trim()
            .parse()
            .map_err(|_| format!("{n:?} is not a whole number"))?;
        if n != 0 && !n.is_power_of_two() {
            return Err(format!(
                "divisions {n} is not a power of two or 0 (0 disables rounding up)"
            ));
        }
        let n = plain(n);
        if k.trim() == ">" {
            d[(last + 1).min(ROUNDUP_INTERVALS)..].fill(n);
            continue;
        }
        let mb = parse_pow2(k, "interval")?;
        let idx = (63 - mb.leading_zeros() as usize).min(ROUNDUP_INTERVALS - 1);
        if first {
            d[..idx].fill(n);
            first = false;
        }
        d[idx] = n;
        last = idx;
    }
    Ok(d)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A key or value of megabytes is quoted clipped: the message stays short.
    #[test]
    fn long_keys_and_values_are_clipped_in_the_message() {
        let key = "k".repeat(100_000);
        let e = AllocatorConfig::parse(&format!("{key}:1"))
            .unwrap_err()
            .to_string();
        assert!(e.len() < 1_000, "{} bytes", e.len());
        assert!(e.contains("(100000 bytes)"), "{e}");
        let value = "x".repeat(100_000);
        let e = AllocatorConfig::parse(&format!("max_split_size_mb:{value}"))
            .unwrap_err()
            .to_string();
        assert!(e.len() < 1_000, "{} bytes", e.len());
    }

    #[test]
    fn parses_pytorch_syntax() {
        let c = AllocatorConfig::parse(
            "expandable_segments:True, max_split_size_mb:128,roundup_power2_divisions:[1:1,4:2,>:8],garbage_collection_threshold:0.6",
        )
        .unwrap();
        assert!(c.expandable_segments);
        assert_eq!(c.max_split_size, 128 << 20);
        // 1 (plain rounding) is stored as 0, as is an interval the list leaves unset
        assert_eq!(c.roundup_power2_divisions[0], 0);
        assert_eq!(c.roundup_power2_divisions[1], 0);
        assert_eq!(c.roundup_power2_divisions[2], 2);
        assert_eq!(c.roundup_power2_divisions[3], 8);
        assert_eq!(c.roundup_power2_divisions[15], 8);
        assert_eq!(c.garbage_collection_threshold, Some(0.6));
        let c = AllocatorConfig::parse("roundup_power2_divisions:4").unwrap();
        assert!(c.roundup_power2_divisions.iter().all(|&d| d == 4));
        assert_eq!(
            AllocatorConfig::parse("").unwrap(),
            AllocatorConfig::default()
        );
    }

    #[test]
    fn display_round_trips() {
        for s in [
            "expandable_segments:False",
            "expandable_segments:True,max_split_size_mb:200,roundup_power2_divisions:[1:1,4:2,>:8]",
            "garbage_collection_threshold:0.5",
            "backend:cudaMallocAsync,expandable_segments:False",
            "page_recycle_threshold:0.9",
            "page_recycle_threshold:0",
            "expandable_segments:True,page_recycle_threshold:1",
            "step_plans:False",
            "expandable_segments:True,step_plans:True",
        ] {
            let c = AllocatorConfig::parse(s).unwrap();
            assert_eq!(
                AllocatorConfig::parse(&c.to_string()).unwrap(),
                c,
                "{s} -> {c}"
            );
        }
    }

    #[test]
    fn errors_name_the_key() {
        let cases = [
            (
                "expandible_segments:True",
                "expandible_segments",
                "unknown key",
            ),
            (
                "expandable_segments:yes",
                "expandable_segments",
                "not True or False",
            ),
            ("max_split_size_mb:abc", "max_split_size_mb", "whole number"),
            ("max_split_size_mb:5", "max_split_size_mb", "minimum"),
            (
                "max_split_size_mb:99999999999999999",
                "max_split_size_mb",
                "too large",
            ),
            (
                "roundup_power2_divisions:3",
                "roundup_power2_divisions",
                "power of two",
            ),
            (
                "roundup_power2_divisions:[3:1]",
                "roundup_power2_divisions",
                "power of two",
            ),
            // (intervals in any order are accepted, as in PyTorch)
            (
                "roundup_power2_divisions:[4:1,2:3]",
                "roundup_power2_divisions",
                "power of two",
            ),
            ("roundup_power2_divisions:[4:1", "", "unclosed"),
            (
                "garbage_collection_threshold:1.5",
                "garbage_collection_threshold",
                "outside",
            ),
            ("expandable_segments", "expandable_segments", "no value"),
            ("a]", "", "unbalanced"),
            ("backend:cuda", "backend", "not a backend"),
            (
                "page_recycle_threshold:-0.5",
                "page_recycle_threshold",
                "outside [0, 1]",
            ),
            (
                "page_recycle_threshold:1.01",
                "page_recycle_threshold",
                "outside",
            ),
            (
                "page_recycle_threshold:NaN",
                "page_recycle_threshold",
                "outside",
            ),
            (
                "page_recycle_threshold:high",
                "page_recycle_threshold",
                "not a number",
            ),
        ];
        for (input, key, msg) in cases {
            let e = AllocatorConfig::parse(input).unwrap_err();
            assert_eq!(e.key.as_deref().unwrap_or(""), key, "{input}: {e}");
            assert!(e.to_string().contains(msg), "{input}: {e}");
            assert!(
                e.to_string()
                    .contains("valid keys: backend, expandable_segments"),
                "{e}"
            );
        }
    }

    proptest::proptest! {
        #[test]
        fn never_panics(s in "[a-z_:,\\[\\]>0-9. ]{0,40}") {
            let _ = AllocatorConfig::parse(&s);
        }
    }
}
