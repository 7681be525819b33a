//! Human-readable byte sizes: `ByteSize::gib(2)`, `"512MiB".parse()`, `format!("{}", size)`.

use std::fmt;
use std::str::FromStr;

/// A number of bytes, parsed from and printed as human-readable text.
///
/// Binary units (`KiB`, `MiB`, `GiB`, `TiB`) are powers of 1024; decimal units (`KB`, `MB`, `GB`,
/// `TB`) powers of 1000, as in the SI. A bare number (or `B`) is bytes, and whole: `"1.5"` is
/// an error (a fraction needs its unit, `"1.5 GiB"`). Fractions of a unit are rounded down to
/// whole bytes. Underscores between digits are separators, as in Rust (`"1_000 MiB"`).
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
    /// `n` KiB (1024 bytes each), saturating at `u64::MAX` bytes (which no device has, so an
    /// allocation of it fails with an error); [`ByteSize::checked_kib`] reports the overflow.
    pub const fn kib(n: u64) -> Self {
        Self(n.saturating_mul(KIB))
    }
    /// `n` MiB, saturating at `u64::MAX` bytes (see [`ByteSize::kib`]).
    pub const fn mib(n: u64) -> Self {
        Self(n.saturating_mul(MIB))
    }
    /// `n` GiB, saturating at `u64::MAX` bytes (see [`ByteSize::kib`]).
    pub const fn gib(n: u64) -> Self {
        Self(n.saturating_mul(GIB))
    }
    /// `n` KiB, or an error when that many bytes do not fit in 64 bits.
    pub fn checked_kib(n: u64) -> Result<Self, ByteSizeError> {
        Self::checked(n, KIB, "KiB")
    }
    /// `n` MiB, or an error when that many bytes do not fit in 64 bits.
    pub fn checked_mib(n: u64) -> Result<Self, ByteSizeError> {
        Self::checked(n, MIB, "MiB")
    }
    /// `n` GiB, or an error when that many bytes do not fit in 64 bits.
    pub fn checked_gib(n: u64) -> Result<Self, ByteSizeError> {
        Self::checked(n, GIB, "GiB")
    }
    fn checked(n: u64, unit: u64, name: &str) -> Result<Self, ByteSizeError> {
        n.checked_mul(unit).map(Self).ok_or_else(|| ByteSizeError {
            input: format!("{n} {name}"),
            reason: "too large for 64 bits",
        })
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
        let mut v = n as f64 / div as f64;
        let mut unit = unit;
        // Just under the next unit, two decimals would print 1024.00 of this one: say 1.00 of
        // the next instead.
        if v >= 1023.995 && unit != "TiB" {
            v /= 1024.0;
            unit = match unit {
                "KiB" => "MiB",
                "MiB" => "GiB",
                _ => "TiB",
            };
        }
        // The largest values would print as 16777216.00 TiB (2^64, one past u64::MAX) and not
        // parse back: print them rounded down instead.
        if unit == "TiB" && v >= 16_777_215.995 {
            return write!(f, "16777215.99 TiB");
        }
        write!(f, "{v:.2} {unit}")
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
        // digit separators as Rust writes them: "1_000 MiB"
        let owned: String;
        let t = if s.contains('_') {
            owned = s.trim().replace('_', "");
            owned.as_str()
        } else {
            s.trim()
        };
        if t.is_empty() {
            return Err(err("empty; expected a number and a unit such as \"2 GiB\""));
        }
        let split = t
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(t.len());
        let (num, unit) = t.split_at(split);
        let unit = unit.trim();
        if t.starts_with('-') {
            return Err(err("a size cannot be negative"));
        }
        if num.is_empty() {
            return Err(err("no number before the unit"));
        }
        if unit.len() > 1
            && unit.starts_with(['e', 'E'])
            && unit[1..]
                .trim_start_matches(['+', '-'])
                .starts_with(|c: char| c.is_ascii_digit())
        {
            return Err(err(
                "scientific notation is not read; write the number out (1000 KiB, 1.5 GiB)",
            ));
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
        // Exact decimal arithmetic (no floating point): `int.frac` × unit, rounded down; more
        // than 19 fractional digits cannot change the result by a whole byte and are ignored.
        let (int, frac) = num.split_once('.').unwrap_or((num, ""));
        if frac.contains('.') || (int.is_empty() && frac.is_empty()) {
            return Err(err("not a number"));
        }
        // "1.5" alone is no size a user meant in bytes (1.5 GiB, most likely): refused, not
        // read as 1 byte.
        if mult == 1 && frac.bytes().any(|d| d != b'0') {
            return Err(err(
                "a fraction of a byte; give the unit of the fraction, e.g. \"1.5 GiB\"",
            ));
        }
        let too_large = || err("too large for 64 bits");
        let int: u128 = if int.is_empty() {
            0
        } else {
            // only digits here: a parse failure is an overflow of u128
            int.parse().map_err(|_| too_large())?
        };
        let frac = &frac[..frac.len().min(19)];
        let frac_bytes = if frac.is_empty() {
            0
        } else {
            let f: u128 = frac.parse().map_err(|_| err("not a number"))?;
            f * mult as u128 / 10u128.pow(frac.len() as u32)
        };
        let bytes = int
            .checked_mul(mult as u128)
            .and_then(|b| b.checked_add(frac_bytes))
            .ok_or_else(too_large)?;
        u64::try_from(bytes).map(ByteSize).map_err(|_| too_large())
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
        // digit separators (a macro's "1_000 MiB" said "unknown unit")
        assert_eq!(
            "1_000 MiB".parse::<ByteSize>().unwrap(),
            ByteSize::mib(1000)
        );
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
            "1e3 KiB",
        ] {
            let e = bad.parse::<ByteSize>().unwrap_err();
            assert_eq!(e.input, bad);
            assert!(e.to_string().contains("invalid byte size"), "{e}");
        }
        let e = "2 GiX".parse::<ByteSize>().unwrap_err();
        assert!(e.reason.contains("unknown unit"));
        // "1e3 KiB" said "unknown unit" (found by a newcomer's crate)
        for s in ["1e3 KiB", "2E-1GiB", "1e3"] {
            let e = s.parse::<ByteSize>().unwrap_err();
            assert!(e.reason.contains("scientific notation"), "{s}: {e}");
        }
        let e = "20000000 TiB".parse::<ByteSize>().unwrap_err();
        assert!(e.reason.contains("too large"));
    }

    #[test]
    fn a_fraction_of_a_byte_is_refused() {
        // "--capacity 1.5" read as 1 byte (found by the CLI's hostile pass)
        for s in ["1.5", "0.5", "1.25 B", "7.01bytes"] {
            let e = s.parse::<ByteSize>().unwrap_err();
            assert!(e.reason.contains("fraction of a byte"), "{s}: {e}");
        }
        assert_eq!("3.0".parse::<ByteSize>().unwrap().0, 3);
        assert_eq!("3.".parse::<ByteSize>().unwrap().0, 3);
        assert_eq!("0.5 KiB".parse::<ByteSize>().unwrap().0, 512);
    }

    #[test]
    fn a_negative_size_is_named_as_negative() {
        // "-1" said "no number before the unit" (found by the CLI's hostile pass)
        for s in ["-1", "-1 GiB", " -0.5MiB"] {
            let e = s.parse::<ByteSize>().unwrap_err();
            assert_eq!(e.reason, "a size cannot be negative", "{s}");
        }
    }

    #[test]
    fn the_largest_sizes_print_and_parse_back() {
        // found by the fuzz harness: u64::MAX printed as "16777216.00 TiB" did not parse; now
        // sizes above u64::MAX are errors, and the largest ones print rounded down
        let s = ByteSize(u64::MAX).to_string();
        assert_eq!(s, "16777215.99 TiB");
        let back = s.parse::<ByteSize>().unwrap();
        assert!(u64::MAX - back.0 < 1 << 34, "{}", back.0);
        assert!("16800000 TiB".parse::<ByteSize>().is_err());
        assert!("16777216.00 TiB".parse::<ByteSize>().is_err());
    }

    #[test]
    fn displays_like_pytorch() {
        assert_eq!(ByteSize::gib(2).to_string(), "2.00 GiB");
        assert_eq!(ByteSize(512).to_string(), "512 bytes");
        assert_eq!(ByteSize(1536).to_string(), "1.50 KiB");
        // just under the next unit: not "1024.00 KiB"
        assert_eq!(ByteSize(MIB - 1).to_string(), "1.00 MiB");
        assert_eq!(ByteSize(GIB - 1).to_string(), "1.00 GiB");
        assert_eq!(ByteSize(MIB - 6 * KIB).to_string(), "1018.00 KiB");
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
