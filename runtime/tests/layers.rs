//! The runtime's layers, enforced: a module may name (`crate::…`) only modules of its own
//! layer or below, as `lib.rs` documents them (backend → allocator → device and buffers →
//! guards and sources → retry → training glue). The upward references that exist today are
//! listed in [`KNOWN_UPWARD`] (debt, issue 38); a new one fails this test, and so does a listed
//! one that is gone (the list only shrinks). Test code (after `#[cfg(test)]`) is not checked.

use std::collections::BTreeSet;
use std::path::Path;

/// Each top-level module of `runtime/src` and its layer (lower numbers lie below).
const LAYERS: &[(&str, u8)] = &[
    ("size", 0),
    ("config", 0),
    ("backend", 0),
    ("error", 0),
    ("leak_report", 0),
    ("panic_text", 0),
    ("retry_report", 0),
    ("alloc", 1),
    ("buffer", 2),
    ("charge", 2),
    ("device", 2),
    ("cuda", 2),
    ("export", 2),
    ("guard", 3),
    ("source", 3),
    ("retry", 4),
    ("train", 5),
    ("nccl", 5),
    ("macro_support", 5),
];

/// Files not in a layer: the crate root (re-exports) and the fuzzing support for tests.
const UNLAYERED: &[&str] = &["lib", "fuzzing"];

/// The crate root's re-exports, by the module they come from (`crate::Device` is `device`).
const ROOT_NAMES: &[(&str, &str)] = &[
    ("Allocation", "alloc"),
    ("CachingAllocator", "alloc"),
    ("MemoryStats", "alloc"),
    ("DeviceBuffer", "buffer"),
    ("Charge", "charge"),
    ("AllocatorConfig", "config"),
    ("ConfigError", "config"),
    ("Device", "device"),
    ("BudgetExceeded", "error"),
    ("Error", "error"),
    ("OomError", "error"),
    ("Result", "error"),
    ("ByteSize", "size"),
    ("ByteSizeError", "size"),
    ("MemorySource", "source"),
    ("MemoryUsage", "source"),
    ("BatchPlan", "retry_report"),
    ("Chunk", "retry_report"),
    ("IsOom", "retry"),
    ("RetryEngine", "retry"),
    ("RetryError", "retry"),
    ("RetryPolicy", "retry"),
    ("Step", "retry"),
    ("find_max_batch", "retry"),
    ("enable_grad", "guard"),
    ("inference_mode", "guard"),
    ("is_grad_enabled", "guard"),
    ("is_inference_mode", "guard"),
    ("no_grad", "guard"),
    ("set_grad_enabled", "guard"),
    ("set_grad_mode_guard", "guard"),
    ("with_grad_enabled", "guard"),
    ("with_inference_mode", "guard"),
    ("with_no_grad", "guard"),
    ("EmptyCacheOnDrop", "guard"),
    ("GradGuard", "guard"),
    ("GradMode", "guard"),
    ("LeakAction", "guard"),
    ("LeakCheck", "guard"),
    ("LeakReport", "leak_report"),
    ("LeakedBuffer", "leak_report"),
    ("MemoryBudget", "guard"),
    ("PeakScope", "guard"),
    ("cudarc", ""),
];

/// Upward references today (file under `runtime/src`, the module it names): none. `Error` holds
/// the retry engine's report, whose plain data lies at layer 0 (`retry_report`). Kept so that
/// an exception, if one must be tolerated again, is listed here and can only shrink.
const KNOWN_UPWARD: &[(&str, &str)] = &[];

fn layer(module: &str) -> Option<u8> {
    LAYERS.iter().find(|(m, _)| *m == module).map(|&(_, l)| l)
}

/// The top-level modules a file's code names through `crate::`, with the line of each.
fn named_modules(code: &str) -> Vec<(String, usize)> {
    // full-line comments (doc links name items, they import nothing) and test code left out
    let kept: Vec<&str> = code
        .lines()
        .take_while(|l| !l.trim_start().starts_with("#[cfg(test)]"))
        .map(|l| {
            if l.trim_start().starts_with("//") {
                ""
            } else {
                l
            }
        })
        .collect();
    let text = kept.join("\n");
    let mut out = Vec::new();
    let mut rest = text.as_str();
    let mut offset = 0;
    while let Some(i) = rest.find("crate::") {
        let at = offset + i;
        let after = &rest[i + "crate::".len()..];
        let line = text[..at].matches('\n').count() + 1;
        let mut names = Vec::new();
        if let Some(group) = after.strip_prefix('{') {
            // `crate::{a, b::c, d::{e, f}}`: the first name of each item at depth 1
            let (mut depth, mut item) = (1, String::new());
            for c in group.chars() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 1 => {
                        names.push(std::mem::take(&mut item));
                        break;
                    }
                    '}' => depth -= 1,
                    ',' if depth == 1 => names.push(std::mem::take(&mut item)),
                    _ if depth == 1 => item.push(c),
                    _ => {}
                }
            }
        } else {
            names.push(after.to_string());
        }
        for n in names {
            let word: String = n
                .trim_start()
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            if !word.is_empty() {
                out.push((word, line));
            }
        }
        offset = at + "crate::".len();
        rest = &text[offset..];
    }
    out
}

fn rust_files(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

#[test]
fn no_module_names_a_layer_above_its_own() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut upward = BTreeSet::new();
    let mut problems = Vec::new();
    for f in &files {
        let rel = f
            .strip_prefix(&src)
            .unwrap()
            .to_string_lossy()
            .replace('\\', "/");
        let top = rel.split('/').next().unwrap().trim_end_matches(".rs");
        if UNLAYERED.contains(&top) {
            continue;
        }
        let Some(own) = layer(top) else {
            problems.push(format!("{rel}: module `{top}` has no layer in LAYERS"));
            continue;
        };
        let code = std::fs::read_to_string(f).unwrap();
        for (name, line) in named_modules(&code) {
            let module = ROOT_NAMES
                .iter()
                .find(|(n, _)| *n == name)
                .map_or(name.as_str(), |&(_, m)| m);
            if module.is_empty() {
                continue;
            }
            let Some(theirs) = layer(module) else {
                problems.push(format!(
                    "{rel}:{line}: `crate::{name}` is neither a layered module nor a known re-export"
                ));
                continue;
            };
            if theirs > own {
                let known = KNOWN_UPWARD.contains(&(rel.as_str(), module));
                upward.insert((rel.clone(), module.to_string()));
                if !known {
                    problems.push(format!(
                        "{rel}:{line}: `{top}` (layer {own}) names `{module}` (layer {theirs}), a layer above it"
                    ));
                }
            }
        }
    }
    for &(file, module) in KNOWN_UPWARD {
        if !upward.contains(&(file.to_string(), module.to_string())) {
            problems.push(format!(
                "{file} no longer names `{module}`: take it off KNOWN_UPWARD"
            ));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn the_scanner_reads_grouped_and_plain_paths() {
    let code = "use crate::{alloc::X, retry::{A, B}, Device};\n\
                // use crate::train::Nope;\n\
                fn f(_: crate::guard::G) {}\n\
                #[cfg(test)]\nmod tests { use crate::nccl::Z; }\n";
    let names: Vec<String> = named_modules(code).into_iter().map(|(n, _)| n).collect();
    assert_eq!(names, ["alloc", "retry", "Device", "guard"]);
}
