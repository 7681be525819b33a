//! Size and shape of the retry engine's source (`runtime/src/retry/`): no file over
//! [`MAX_FILE_LINES`] lines, no `fn` over [`MAX_FN_LINES`] lines (from its `fn` line to its
//! closing brace), and no cycle in the file-level import graph inside `retry/`.
//!
//! The scanner is a small lexer: comments, string literals (raw and byte strings too) and char
//! literals are blanked before braces are matched and paths are read, so a `{` in a message or a
//! doc comment counts for nothing. An import is any `super::…`, `self::…` or `crate::retry::…`
//! path in code (in a `use` or written inline), resolved through the modules' `use` bindings
//! (the re-exports of a `mod.rs`) to the file that defines the item. Doc links are comments and
//! do not count.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The most lines a file under `retry/` may have (its unit tests included).
const MAX_FILE_LINES: usize = 600;
/// The most lines a function may span, from its `fn` line to its closing brace.
const MAX_FN_LINES: usize = 100;

fn retry_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("src")
        .join("retry")
}

/// Every `.rs` file under `dir`, as (path relative to `src/`, text), sorted by path.
fn rust_files(dir: &Path) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).expect("read retry/") {
            let path = entry.expect("dir entry").path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let text = std::fs::read_to_string(&path).expect("read a .rs file");
                let src = dir.parent().expect("src/");
                let rel = path.strip_prefix(src).expect("under src/");
                out.push((rel.to_string_lossy().replace('\\', "/"), text));
            }
        }
    }
    out.sort();
    out
}

// ---------------------------------------------------------------------------------------------
// Lexing: blank comments, strings and chars (newlines kept, so line numbers hold).

fn is_ident(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

/// `src` with comments, string literals and char literals replaced by spaces (newlines kept).
fn blank(src: &str) -> Vec<char> {
    let s: Vec<char> = src.chars().collect();
    let mut out = s.clone();
    let mut i = 0;
    while i < s.len() {
        let end = if s[i] == '/' && s.get(i + 1) == Some(&'/') {
            line_comment_end(&s, i)
        } else if s[i] == '/' && s.get(i + 1) == Some(&'*') {
            block_comment_end(&s, i)
        } else if let Some(end) = raw_string_end(&s, i) {
            end
        } else if s[i] == '"' {
            string_end(&s, i)
        } else if s[i] == '\'' {
            char_end(&s, i).unwrap_or(i + 1)
        } else {
            i + 1
        };
        if end > i + 1 {
            for c in &mut out[i..end] {
                if *c != '\n' {
                    *c = ' ';
                }
            }
        }
        i = end;
    }
    out
}

fn line_comment_end(s: &[char], i: usize) -> usize {
    s[i..]
        .iter()
        .position(|&c| c == '\n')
        .map_or(s.len(), |p| i + p)
}

/// Block comments nest in Rust.
fn block_comment_end(s: &[char], mut i: usize) -> usize {
    let mut depth = 0;
    while i < s.len() {
        if s[i] == '/' && s.get(i + 1) == Some(&'*') {
            depth += 1;
            i += 2;
        } else if s[i] == '*' && s.get(i + 1) == Some(&'/') {
            depth -= 1;
            i += 2;
            if depth == 0 {
                return i;
            }
        } else {
            i += 1;
        }
    }
    s.len()
}

/// `r"…"`, `r#"…"#`, `br#"…"#` starting at `i` (an `r` or `b` that begins a token).
fn raw_string_end(s: &[char], i: usize) -> Option<usize> {
    if i > 0 && is_ident(s[i - 1]) {
        return None;
    }
    let mut j = i;
    if s[j] == 'b' {
        j += 1;
    }
    if s.get(j) != Some(&'r') {
        return None;
    }
    j += 1;
    let hashes = s[j..].iter().take_while(|&&c| c == '#').count();
    j += hashes;
    if s.get(j) != Some(&'"') {
        return None;
    }
    j += 1;
    while j < s.len() {
        if s[j] == '"'
            && s[j + 1..]
                .iter()
                .take(hashes)
                .filter(|&&c| c == '#')
                .count()
                == hashes
        {
            return Some(j + 1 + hashes);
        }
        j += 1;
    }
    Some(s.len())
}

fn string_end(s: &[char], mut i: usize) -> usize {
    i += 1;
    while i < s.len() {
        match s[i] {
            '\\' => i += 2,
            '"' => return i + 1,
            _ => i += 1,
        }
    }
    s.len()
}

/// A char literal at `i` (`'x'`, `'\n'`, `'\''`, `'\u{7b}'`), or `None` for a lifetime or
/// label.
fn char_end(s: &[char], i: usize) -> Option<usize> {
    if s.get(i + 1) == Some(&'\\') {
        // the escaped character itself may be a quote: the closing one comes after it
        let close = s.get(i + 3..)?.iter().position(|&c| c == '\'')?;
        return Some(i + 3 + close + 1);
    }
    (s.get(i + 2) == Some(&'\'')).then_some(i + 3)
}

// ---------------------------------------------------------------------------------------------
// Tokens over the blanked text.

#[derive(Clone, Debug, PartialEq)]
struct Tok {
    text: String,
    line: usize,
}

fn tokens(code: &[char]) -> Vec<Tok> {
    let mut out = Vec::new();
    let mut line = 1;
    let mut i = 0;
    while i < code.len() {
        let c = code[i];
        if c == '\n' {
            line += 1;
            i += 1;
        } else if c.is_whitespace() {
            i += 1;
        } else if is_ident(c) {
            let n = code[i..].iter().take_while(|&&c| is_ident(c)).count();
            out.push(Tok {
                text: code[i..i + n].iter().collect(),
                line,
            });
            i += n;
        } else if c == ':' && code.get(i + 1) == Some(&':') {
            out.push(Tok {
                text: "::".into(),
                line,
            });
            i += 2;
        } else {
            out.push(Tok {
                text: c.to_string(),
                line,
            });
            i += 1;
        }
    }
    out
}

/// Index of the token that closes the bracket opened at `open`.
fn closing(toks: &[Tok], open: usize) -> usize {
    let (o, c) = match toks[open].text.as_str() {
        "{" => ("{", "}"),
        "(" => ("(", ")"),
        _ => ("[", "]"),
    };
    let mut depth = 0usize;
    for (j, t) in toks.iter().enumerate().skip(open) {
        if t.text == o {
            depth += 1;
        } else if t.text == c {
            depth -= 1;
            if depth == 0 {
                return j;
            }
        }
    }
    toks.len() - 1
}

// ---------------------------------------------------------------------------------------------
// Functions.

/// A function's name, the line of its `fn` and how many lines it spans.
#[derive(Debug, PartialEq)]
struct FnSpan {
    name: String,
    line: usize,
    lines: usize,
}

/// Every `fn` with a body: from the `fn` line to the line of the brace that closes its body.
fn functions(src: &str) -> Vec<FnSpan> {
    let toks = tokens(&blank(src));
    let mut out = Vec::new();
    for (i, t) in toks.iter().enumerate() {
        let named = toks
            .get(i + 1)
            .is_some_and(|n| n.text.starts_with(is_ident_start));
        if t.text != "fn" || !named {
            continue; // `fn(u8) -> u8` is a pointer type
        }
        if let Some(open) = body_start(&toks, i + 2) {
            let close = closing(&toks, open);
            out.push(FnSpan {
                name: toks[i + 1].text.clone(),
                line: t.line,
                lines: toks[close].line - t.line + 1,
            });
        }
    }
    out
}

fn is_ident_start(c: char) -> bool {
    c.is_alphabetic() || c == '_'
}

/// The `{` that opens the body of the `fn` whose signature starts at `from`; `None` when a `;`
/// ends the signature first (a trait method without a default body).
fn body_start(toks: &[Tok], from: usize) -> Option<usize> {
    let mut depth = 0i32; // `(` and `[`: `[u64; 3]` in a signature is no end
    for (j, t) in toks.iter().enumerate().skip(from) {
        match t.text.as_str() {
            "(" | "[" => depth += 1,
            ")" | "]" => depth -= 1,
            "{" if depth == 0 => return Some(j),
            ";" if depth == 0 => return None,
            _ => {}
        }
    }
    None
}

// ---------------------------------------------------------------------------------------------
// Modules and imports.

/// A module path below the crate root, e.g. `["retry", "engine"]`.
type ModPath = Vec<String>;

/// The module a file is, from its path below `src/` (`retry/mod.rs` is `retry`).
fn file_module(rel: &str) -> ModPath {
    let mut parts: Vec<String> = rel
        .trim_end_matches(".rs")
        .split('/')
        .map(String::from)
        .collect();
    if parts.last().is_some_and(|p| p == "mod" || p == "lib") {
        parts.pop();
    }
    parts
}

/// One path written in code: the scope it is written in, its segments, its line.
#[derive(Clone, Debug)]
struct PathUse {
    scope: ModPath,
    segs: Vec<String>,
    line: usize,
}

/// What one file declares and uses.
#[derive(Default)]
struct FileScan {
    /// Inline modules (`mod tests { … }`), with the module path of each.
    inline_mods: Vec<ModPath>,
    /// Names bound by `use` (alias or last segment), per scope: name → the path bound.
    bindings: Vec<(ModPath, String, PathUse)>,
    /// Every path that starts with `super`, `self` or `crate`.
    paths: Vec<PathUse>,
}

/// The module each token sits in: the file's module, or an inline `mod name { … }` inside it.
fn token_scopes(toks: &[Tok], file_mod: &ModPath, scan: &mut FileScan) -> Vec<ModPath> {
    let mut scopes = vec![file_mod.clone(); toks.len()];
    let mut i = 0;
    while i + 2 < toks.len() {
        if toks[i].text == "mod" && toks[i + 2].text == "{" {
            let close = closing(toks, i + 2);
            let mut inner = scopes[i].clone();
            inner.push(toks[i + 1].text.clone());
            for s in &mut scopes[i + 2..=close] {
                *s = inner.clone();
            }
            scan.inline_mods.push(inner);
        }
        i += 1;
    }
    scopes
}

/// The leaves of the `use` tree starting at `i` (after `use`), as (path, bound name); returns the
/// index after the tree.
fn use_tree(
    toks: &[Tok],
    mut i: usize,
    prefix: Vec<String>,
    out: &mut Vec<(Vec<String>, String)>,
) -> usize {
    let mut path = prefix;
    loop {
        let t = toks[i].text.as_str();
        match t {
            "::" => i += 1,
            "{" => {
                i += 1;
                while toks[i].text != "}" {
                    i = use_tree(toks, i, path.clone(), out);
                    if toks[i].text == "," {
                        i += 1;
                    }
                }
                return i + 1;
            }
            "*" => {
                out.push((path, "*".into()));
                return i + 1;
            }
            "self" if !path.is_empty() => {
                let name = path.last().cloned().unwrap_or_default();
                return leaf(toks, i + 1, path, name, out);
            }
            _ if t.starts_with(is_ident_start) => {
                path.push(t.to_string());
                if toks[i + 1].text != "::" {
                    return leaf(toks, i + 1, path, t.to_string(), out);
                }
                i += 1;
            }
            _ => return i,
        }
    }
}

/// A use tree's leaf, with its `as` alias if any.
fn leaf(
    toks: &[Tok],
    i: usize,
    path: Vec<String>,
    name: String,
    out: &mut Vec<(Vec<String>, String)>,
) -> usize {
    if toks[i].text == "as" {
        out.push((path, toks[i + 1].text.clone()));
        return i + 2;
    }
    out.push((path, name));
    i
}

const PATH_ROOTS: [&str; 3] = ["super", "self", "crate"];

fn scan_file(rel: &str, src: &str) -> FileScan {
    let toks = tokens(&blank(src));
    let mut scan = FileScan::default();
    let scopes = token_scopes(&toks, &file_module(rel), &mut scan);
    let mut i = 0;
    while i < toks.len() {
        // `a::super` is no root, nor `pub(in crate::retry)` an import
        let after_sep = i > 0 && (toks[i - 1].text == "::" || toks[i - 1].text == "in");
        if toks[i].text == "use" && !after_sep {
            let mut leaves = Vec::new();
            let end = use_tree(&toks, i + 1, Vec::new(), &mut leaves);
            for (mut segs, name) in leaves {
                // `use` paths are relative to their module unless they start at a root.
                if !segs
                    .first()
                    .is_some_and(|s| PATH_ROOTS.contains(&s.as_str()))
                {
                    segs.insert(0, "self".into());
                }
                let p = PathUse {
                    scope: scopes[i].clone(),
                    segs,
                    line: toks[i].line,
                };
                scan.paths.push(p.clone());
                scan.bindings.push((scopes[i].clone(), name, p));
            }
            i = end.max(i + 1);
        } else if PATH_ROOTS.contains(&toks[i].text.as_str()) && !after_sep {
            let mut segs = vec![toks[i].text.clone()];
            let mut j = i + 1;
            while j + 1 < toks.len()
                && toks[j].text == "::"
                && toks[j + 1].text.starts_with(is_ident_start)
            {
                segs.push(toks[j + 1].text.clone());
                j += 2;
            }
            if segs.len() > 1 {
                scan.paths.push(PathUse {
                    scope: scopes[i].clone(),
                    segs,
                    line: toks[i].line,
                });
            }
            i = j;
        } else {
            i += 1;
        }
    }
    scan
}

/// The modules of a set of files and how names resolve among them.
struct Crate {
    /// Module → the file that holds it (a file module, or an inline module inside it).
    modules: BTreeMap<ModPath, String>,
    /// (scope, name) → the path the name is bound to there.
    bindings: BTreeMap<(ModPath, String), PathUse>,
}

impl Crate {
    fn new(files: &[(String, String)], scans: &[FileScan]) -> Self {
        let mut modules = BTreeMap::new();
        let mut bindings = BTreeMap::new();
        for ((rel, _), scan) in files.iter().zip(scans) {
            modules.insert(file_module(rel), rel.clone());
            for m in &scan.inline_mods {
                modules.insert(m.clone(), rel.clone());
            }
            for (scope, name, p) in &scan.bindings {
                bindings
                    .entry((scope.clone(), name.clone()))
                    .or_insert_with(|| p.clone());
            }
        }
        Crate { modules, bindings }
    }

    /// The module that defines what `p` names (following `use` bindings), if it is one we hold.
    fn resolve(&self, p: &PathUse, depth: usize) -> Option<ModPath> {
        let mut cur = p.scope.clone();
        let mut rest = p.segs.as_slice();
        while let Some(first) = rest.first() {
            match first.as_str() {
                "crate" => cur.clear(),
                "self" => {}
                "super" => {
                    cur.pop()?;
                }
                _ => break,
            }
            rest = &rest[1..];
        }
        for seg in rest {
            let mut next = cur.clone();
            next.push(seg.clone());
            if self.modules.contains_key(&next) {
                cur = next;
            } else if let Some(bound) = self.bindings.get(&(cur.clone(), seg.clone())) {
                return if depth < 8 {
                    self.resolve(bound, depth + 1)
                } else {
                    None
                };
            } else {
                break;
            }
        }
        self.modules.contains_key(&cur).then_some(cur)
    }
}

/// One import edge: the file that imports, the file it imports from, where.
#[derive(Clone, Debug)]
struct Edge {
    from: String,
    to: String,
    line: usize,
    path: String,
}

/// File-level import edges among `files` (paths resolved to the file defining the item).
fn import_edges(files: &[(String, String)]) -> Vec<Edge> {
    let scans: Vec<FileScan> = files.iter().map(|(rel, src)| scan_file(rel, src)).collect();
    let krate = Crate::new(files, &scans);
    let mut edges = Vec::new();
    for ((rel, _), scan) in files.iter().zip(&scans) {
        for p in &scan.paths {
            let Some(target) = krate.resolve(p, 0) else {
                continue;
            };
            let to = &krate.modules[&target];
            if to != rel {
                edges.push(Edge {
                    from: rel.clone(),
                    to: to.clone(),
                    line: p.line,
                    path: p.segs.join("::"),
                });
            }
        }
    }
    edges
}

/// Cycles in the import graph, one per strongly connected component of more than one file, each
/// as the edges that close it.
fn import_cycles(edges: &[Edge]) -> Vec<Vec<Edge>> {
    let mut next: BTreeMap<&str, Vec<&Edge>> = BTreeMap::new();
    for e in edges {
        next.entry(&e.from).or_default().push(e);
    }
    let mut cycles = Vec::new();
    let mut seen: BTreeSet<String> = BTreeSet::new();
    for start in next.keys() {
        if seen.contains(*start) {
            continue;
        }
        if let Some(cycle) = shortest_cycle(start, &next) {
            seen.extend(cycle.iter().map(|e| e.from.clone()));
            cycles.push(cycle);
        }
    }
    cycles
}

/// The shortest cycle through `start` (breadth first), as its edges.
fn shortest_cycle(start: &str, next: &BTreeMap<&str, Vec<&Edge>>) -> Option<Vec<Edge>> {
    let mut came: BTreeMap<&str, &Edge> = BTreeMap::new();
    let mut queue = std::collections::VecDeque::from([start]);
    while let Some(at) = queue.pop_front() {
        for &e in next.get(at).into_iter().flatten() {
            if e.to == start {
                let mut cycle = vec![e.clone()];
                let mut back = at;
                while back != start {
                    let prev = came[back];
                    cycle.push(prev.clone());
                    back = &prev.from;
                }
                cycle.reverse();
                return Some(cycle);
            }
            if !came.contains_key(e.to.as_str()) && e.to != start {
                came.insert(&e.to, e);
                queue.push_back(&e.to);
            }
        }
    }
    None
}

fn describe(cycle: &[Edge]) -> String {
    let steps: Vec<String> = cycle
        .iter()
        .map(|e| format!("{} (line {}: {}) -> {}", e.from, e.line, e.path, e.to))
        .collect();
    steps.join(", ")
}

// ---------------------------------------------------------------------------------------------
// The checks, over any set of files (so the checker's own tests can feed it bad ones).

fn long_files(files: &[(String, String)]) -> Vec<String> {
    files
        .iter()
        .map(|(rel, src)| (rel, src.lines().count()))
        .filter(|&(_, n)| n > MAX_FILE_LINES)
        .map(|(rel, n)| format!("{rel}: {n} lines (limit {MAX_FILE_LINES})"))
        .collect()
}

fn long_functions(files: &[(String, String)]) -> Vec<String> {
    let mut out = Vec::new();
    for (rel, src) in files {
        for f in functions(src)
            .into_iter()
            .filter(|f| f.lines > MAX_FN_LINES)
        {
            out.push(format!(
                "{rel}:{} fn {}: {} lines (limit {MAX_FN_LINES})",
                f.line, f.name, f.lines
            ));
        }
    }
    out
}

fn cycle_messages(files: &[(String, String)]) -> Vec<String> {
    import_cycles(&import_edges(files))
        .iter()
        .map(|c| format!("import cycle: {}", describe(c)))
        .collect()
}

#[test]
fn no_retry_file_is_over_600_lines() {
    let files = rust_files(&retry_dir());
    assert!(
        files.len() > 10,
        "found only {} files under retry/",
        files.len()
    );
    let long = long_files(&files);
    assert!(
        long.is_empty(),
        "files over the limit:\n{}",
        long.join("\n")
    );
}

#[test]
fn no_retry_function_is_over_100_lines() {
    let files = rust_files(&retry_dir());
    let long = long_functions(&files);
    assert!(
        long.is_empty(),
        "functions over the limit:\n{}",
        long.join("\n")
    );
}

#[test]
fn retry_imports_have_no_cycle() {
    let files = rust_files(&retry_dir());
    // The graph is not empty: the scanner does see the engine's imports (of the remembered
    // plans; the batch plan itself lies outside `retry/`, in `retry_report/`).
    let edges = import_edges(&files);
    assert!(
        edges
            .iter()
            .any(|e| e.from.contains("engine") && e.to.contains("memory/")),
        "the engine's imports were not found: {edges:?}"
    );
    let cycles = cycle_messages(&files);
    assert!(cycles.is_empty(), "{}", cycles.join("\n"));
}

// ---------------------------------------------------------------------------------------------
// The checker's own tests: it must see what it is there to see.

fn one(rel: &str, src: &str) -> Vec<(String, String)> {
    vec![(rel.to_string(), src.to_string())]
}

#[test]
fn braces_in_strings_chars_and_comments_do_not_count() {
    let src = r###"fn a() {
    let s = "}}}";
    let c = '}';
    let q = '\'';
    let e = "\"}\\";
    // }
    /* } /* } */ } */
    let r = r##"}"#}"##;
    let l: &'static str = s;
}
fn b() {}
"###;
    let fns = functions(src);
    assert_eq!(
        fns,
        vec![
            FnSpan {
                name: "a".into(),
                line: 1,
                lines: 10
            },
            FnSpan {
                name: "b".into(),
                line: 11,
                lines: 1
            }
        ]
    );
}

#[test]
fn signatures_with_arrays_pointers_and_no_body() {
    let src =
        "trait T {\n fn x(&self) -> [u8; 2];\n}\nfn y(f: fn(u8) -> u8) -> [u64; 3] {\n [0; 3]\n}\n";
    let fns = functions(src);
    assert_eq!(
        fns,
        vec![FnSpan {
            name: "y".into(),
            line: 4,
            lines: 3
        }]
    );
}

#[test]
fn a_long_file_and_a_long_function_are_named_with_their_length() {
    let body = "    let _x = 1;\n".repeat(MAX_FN_LINES);
    let src = format!(
        "fn long_one() {{\n{body}}}\n{}",
        "\n".repeat(MAX_FILE_LINES)
    );
    let files = one("retry/big.rs", &src);
    let fns = long_functions(&files);
    assert_eq!(
        fns,
        vec![format!(
            "retry/big.rs:1 fn long_one: {} lines (limit {MAX_FN_LINES})",
            MAX_FN_LINES + 2
        )]
    );
    let long = long_files(&files);
    assert_eq!(
        long,
        vec![format!(
            "retry/big.rs: {} lines (limit {MAX_FILE_LINES})",
            MAX_FILE_LINES + MAX_FN_LINES + 2
        )]
    );
}

#[test]
fn a_cycle_through_re_exports_and_inline_paths_is_found() {
    let files = vec![
        ("retry/mod.rs".to_string(), "mod a;\nmod b;\nmod c;\npub use a::A;\npub use c::C;\n".to_string()),
        ("retry/a.rs".to_string(), "use super::b::B;\npub struct A;\n".to_string()),
        ("retry/b.rs".to_string(), "pub struct B;\nfn f() { let _ = super::C; }\n".to_string()),
        ("retry/c/mod.rs".to_string(), "mod d;\npub use d::C;\n".to_string()),
        (
            "retry/c/d.rs".to_string(),
            "// use super::super::b::B; is a comment\npub struct C;\nfn g() -> crate::retry::A { loop {} }\n#[cfg(test)]\nmod tests {\n use super::*;\n}\n"
                .to_string(),
        ),
    ];
    let cycles = cycle_messages(&files);
    assert_eq!(
        cycles,
        vec!["import cycle: retry/a.rs (line 1: super::b::B) -> retry/b.rs, retry/b.rs (line 2: super::C) -> retry/c/d.rs, \
              retry/c/d.rs (line 3: crate::retry::A) -> retry/a.rs"
            .to_string()],
    );
}

#[test]
fn a_graph_without_a_cycle_passes() {
    let files = vec![
        (
            "retry/mod.rs".to_string(),
            "mod a;\nmod b;\npub use a::A;\npub use b::B;\n".to_string(),
        ),
        (
            "retry/a.rs".to_string(),
            "use super::B;\npub struct A;\n#[cfg(test)]\nmod tests {\n use super::*;\n}\n"
                .to_string(),
        ),
        ("retry/b.rs".to_string(), "pub struct B;\n".to_string()),
    ];
    let edges = import_edges(&files);
    assert_eq!(edges.len(), 3, "{edges:?}"); // mod.rs → a, mod.rs → b, a → b
    assert!(cycle_messages(&files).is_empty());
}
