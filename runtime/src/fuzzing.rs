//! A small stable-toolchain fuzzing harness shared by the workspace's fuzz tests
//! (`runtime/tests/fuzz.rs`, `cli/tests/fuzz.rs`): start from a checked-in corpus, mutate inputs
//! (bit flips, byte edits, dictionary insertions, deletions, splices) for a bounded number of
//! cases, and report the first input on which the check panics. Deterministic (fixed seed), so a
//! failure reproduces. Hidden: test tooling, not API.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;

/// xorshift64*: small and deterministic.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// Tokens the mutator inserts: configuration keys, units, and trace syntax.
const DICT: &[&[u8]] = &[
    b"expandable_segments",
    b"max_split_size_mb",
    b"roundup_power2_divisions",
    b"garbage_collection_threshold",
    b"page_recycle_threshold",
    b"backend",
    b":",
    b",",
    b"[",
    b"]",
    b">",
    b"True",
    b"False",
    b"GiB",
    b"MiB",
    b"KB",
    b".",
    b"0",
    b"99999999999999999999",
    b" ",
    b"\n",
    b"a,",
    b"f,",
    b"allocate",
    b"free",
    b"-1",
    b"\x80\x04",
    b"\x95",
    b"}",
    b"(",
    b"u",
    b"e",
    b"t",
];

fn mutate(rng: &mut Rng, input: &[u8], pool: &[Vec<u8>]) -> Vec<u8> {
    let mut v = input.to_vec();
    for _ in 0..1 + rng.below(4) {
        match rng.below(6) {
            0 if !v.is_empty() => {
                let i = rng.below(v.len());
                v[i] ^= 1 << rng.below(8);
            }
            1 if !v.is_empty() => {
                let i = rng.below(v.len());
                v[i] = rng.next() as u8;
            }
            2 => {
                let i = rng.below(v.len() + 1);
                let word = DICT[rng.below(DICT.len())];
                v.splice(i..i, word.iter().copied());
            }
            3 if !v.is_empty() => {
                let i = rng.below(v.len());
                let n = rng.below(v.len() - i + 1);
                v.drain(i..i + n);
            }
            4 => {
                let other = &pool[rng.below(pool.len())];
                let cut = rng.below(v.len() + 1);
                let from = rng.below(other.len() + 1);
                v.truncate(cut);
                v.extend_from_slice(&other[from..]);
            }
            _ => v.push(rng.next() as u8),
        }
    }
    v.truncate(1 << 16);
    v
}

/// The files of a corpus directory, in name order.
pub fn corpus(dir: &Path) -> std::io::Result<Vec<Vec<u8>>> {
    let mut files = std::fs::read_dir(dir)?
        .map(|e| e.map(|e| e.path()))
        .collect::<std::io::Result<Vec<_>>>()?;
    files.sort();
    files.iter().map(std::fs::read).collect()
}

/// A failing case: its index, the input, and the panic message.
#[derive(Debug)]
pub struct Failure {
    /// Case number (corpus files first).
    pub case: usize,
    /// The input.
    pub input: Vec<u8>,
    /// What the check said.
    pub message: String,
}

/// [`fuzz`] for a test: panics with the failing input shown, or when fewer cases ran than asked.
pub fn fuzz_test(dir: &Path, cases: usize, check: impl Fn(&[u8])) {
    let target = dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    match fuzz(dir, cases, check) {
        Ok(ran) => assert!(ran > cases, "{target}: only {ran} cases ran"),
        Err(f) => panic!(
            "{target}: case {} failed on input {:?}: {}",
            f.case,
            String::from_utf8_lossy(&f.input),
            f.message
        ),
    }
}

/// Runs `check` on every file in `dir` and on `cases` mutants; returns the number of cases run,
/// or the first failure (a panic in `check`).
pub fn fuzz(dir: &Path, cases: usize, check: impl Fn(&[u8])) -> Result<usize, Failure> {
    let seeds = corpus(dir).map_err(|e| Failure {
        case: 0,
        input: Vec::new(),
        message: format!("corpus {}: {e}", dir.display()),
    })?;
    if seeds.is_empty() {
        return Err(Failure {
            case: 0,
            input: Vec::new(),
            message: format!("corpus {} is empty", dir.display()),
        });
    }
    // seeded by the corpus's name, not its path, so every checkout runs the same cases
    let salt = dir.file_name().map_or(0, |n| {
        n.as_encoded_bytes()
            .iter()
            .fold(0u64, |h, &b| h.wrapping_mul(31).wrapping_add(b as u64))
    });
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ salt);
    let mut pool = seeds.clone();
    for case in 0..seeds.len() + cases {
        let input = if case < seeds.len() {
            seeds[case].clone()
        } else {
            let base = &pool[rng.below(pool.len())];
            mutate(&mut rng, base, &pool)
        };
        if let Err(e) = catch_unwind(AssertUnwindSafe(|| check(&input))) {
            let message = crate::panic_text::panic_text(e.as_ref())
                .unwrap_or_default()
                .to_owned();
            return Err(Failure {
                case,
                input,
                message,
            });
        }
        if pool.len() < 256 && rng.below(8) == 0 {
            pool.push(input);
        }
    }
    Ok(seeds.len() + cases)
}
