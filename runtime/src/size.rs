//! Human-readable byte sizes: `ByteSize::gib(2)`, `"512MiB".parse()`, `format!("{}", size)`.

use std::fmt;
use std::str::FromStr;

/// A number of bytes, parsed from and printed as human-readable text.
///
/// Binary units (`KiB`, `MiB`, `GiB`, `TiB`) are powers of 1024; decimal units (`KB`, `MB`, `GB`,
/// `TB`) powers of 1000, as in the SI. A bare number (or `B`) is bytes. Fractions are allowed and
/// rounded down to whole bytes.
///
/// ```
/// use oomguard_runtime::ByteSize;
/// assert_eq!("2 GiB".parse::<ByteSize>().unwrap(), ByteSize::gib(2));
/// assert_eq!("1.5GB".parse::<ByteSize>().unwrap().bytes(), 1_500_000_000);
/// assert_eq!(ByteSize::mib(512).to_string(), "512.00 MiB");
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ByteSize(pub u64);

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
const TIB: u64 = 1 << 40;

impl ByteSize {
    /// `n` bytes.
    pub const fn b(n: u64) -> Self {
        Self(n)
    }
    /// `n` KiB (1024 bytes each).
    pub const fn kib(n: u64) -> Self {
        Self(n * KIB)
    }
    /// `n` MiB.
    pub const fn mib(n: u64) -> Self {
        Self(n * MIB)
    }
    /// `n` GiB.
    pub const fn gib(n: u64) -> Self {
        Self(n * GIB)
    }
    /// The number of bytes.
    pub const fn bytes(self) -> u64 {
        self.0
    }
}

impl From<u64> for ByteSize {
    fn from(n: u64) -> Self {
        Self(n)
    }
}

impl From<ByteSize> for u64 {
    fn from(s: ByteSize) -> u64 {
        s.0
    }
}

/// Formats with binary units and two decimals, as PyTorch's messages do: `2.00 GiB`, `512 bytes`.
impl fmt::Display for ByteSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n = self.0;
        let (unit, div) = if n >= TIB {
            ("TiB", TIB)
        } else if n >= GIB {
            ("GiB", GIB)
        } else if n >= MIB {
            ("MiB", MIB)
        } else if n >= KIB {
            ("KiB", KIB)
        } else {
            return write!(f, "{n} bytes");
        };
        write!(f, "{:.2} {unit}", n as f64 / div as f64)
    }
}

/// Why a byte-size string could not be parsed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("invalid byte size {input:?}: {reason}")]
pub struct ByteSizeError {
    /// The text that was given.
    pub input: String,
    /// What is wrong with it.
    pub reason: &'static str,
}

impl FromStr for ByteSize {
    type Err = ByteSizeError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = |reason| ByteSizeError {
            input: s.to_string(),
            reason,
        };
        let t = s.trim();
        if t.is_empty() {
            return Err(err("empty; expected a number and a unit such as \"2 GiB\""));
        }
        let split = t
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(t.len());
        let (num, unit) = t.split_at(split);
        let unit = unit.trim();
        if num.is_empty() {
            return Err(err("no number before the unit"));
        }
        let mult: u64 = match unit.to_ascii_lowercase().as_str() {
            "" | "b" | "byte" | "bytes" => 1,
            "k" | "kib" => KIB,
            "m" | "mib" => MIB,
            "g" | "gib" => GIB,
            "t" | "tib" => TIB,
            "kb" => 1_000,
            "mb" => 1_000_000,
            "gb" => 1_000_000_000,
            "tb" => 1_000_000_000_000,
            _ => {
                return Err(err(
                    "unknown unit; use B, KiB, MiB, GiB, TiB, KB, MB, GB or TB",
                ))
            }
        };
        if let Ok(n) = num.parse::<u64>() {
            return n
                .checked_mul(mult)
                .map(ByteSize)
                .ok_or_else(|| err("too large for 64 bits"));
        }
        let x: f64 = num.parse().map_err(|_| err("not a number"))?;
        let bytes = x * mult as f64;
        // u64::MAX as f64 is 2^64. Sizes just above it are what `Display` prints for the
        // largest values (two decimals round up): read those back as u64::MAX.
        let max = u64::MAX as f64;
        if !bytes.is_finite() || bytes > max * 1.005 {
            return Err(err("too large for 64 bits"));
        }
        Ok(ByteSize(if bytes >= max { u64::MAX } else { bytes as u64 }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_units() {
        assert_eq!("512MiB".parse::<ByteSize>().unwrap(), ByteSize::mib(512));
        assert_eq!("2 GiB".parse::<ByteSize>().unwrap(), ByteSize::gib(2));
        assert_eq!("1.5GB".parse::<ByteSize>().unwrap().0, 1_500_000_000);
        assert_eq!("1.5 GiB".parse::<ByteSize>().unwrap().0, 3 * GIB / 2);
        assert_eq!("4096".parse::<ByteSize>().unwrap().0, 4096);
        assert_eq!(" 7 b ".parse::<ByteSize>().unwrap().0, 7);
        assert_eq!("1kb".parse::<ByteSize>().unwrap().0, 1000);
    }

    #[test]
    fn rejects_bad_input() {
        for bad in [
            "",
            "GiB",
            "2 GiX",
            "1.2.3 MiB",
            "-5",
            "99999999999999999999 TiB",
            "1e3",
        ] {
            let e = bad.parse::<ByteSize>().unwrap_err();
            assert_eq!(e.input, bad);
            assert!(e.to_string().contains("invalid byte size"), "{e}");
        }
        let e = "2 GiX".parse::<ByteSize>().unwrap_err();
        assert!(e.reason.contains("unknown unit"));
        let e = "20000000 TiB".parse::<ByteSize>().unwrap_err();
        assert!(e.reason.contains("too large"));
    }

    #[test]
    fn the_largest_sizes_print_and_parse_back() {
        // found by the fuzz harness: u64::MAX printed as "16777216.00 TiB" did not parse
        let s = ByteSize(u64::MAX).to_string();
        assert_eq!(s, "16777216.00 TiB");
        assert_eq!(s.parse::<ByteSize>().unwrap(), ByteSize(u64::MAX));
        assert!("16800000 TiB".parse::<ByteSize>().is_err());
    }

    #[test]
    fn displays_like_pytorch() {
        assert_eq!(ByteSize::gib(2).to_string(), "2.00 GiB");
        assert_eq!(ByteSize(512).to_string(), "512 bytes");
        assert_eq!(ByteSize(1536).to_string(), "1.50 KiB");
    }

    proptest::proptest! {
        #[test]
        fn display_parse_is_close(n in 0u64..(1u64 << 50)) {
            let s = ByteSize(n).to_string();
            let back: ByteSize = s.parse().unwrap();
            // two decimals: relative error under 0.5%
            let diff = back.0.abs_diff(n) as f64;
            proptest::prop_assert!(diff <= (n as f64) * 0.005 + 1.0, "{} -> {} -> {}", n, s, back.0);
        }

        #[test]
        fn never_panics(s in "\\PC{0,20}") {
            let _ = s.parse::<ByteSize>();
        }
    }
}
