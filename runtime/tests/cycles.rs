//! No circles between files: in `runtime/src` and in `cli/src` (the library's tree), the graph
//! of which file names which other file through a `crate::…` or `super::…` path has no cycle.
//! A path is followed to the file that defines what it names, through the `use` re-exports of
//! the modules on its way (`crate::Device` is `device/mod.rs`, as `lib.rs` re-exports it). A
//! module naming its own submodules is composition, not an edge (a parent owns its children).
//! The cycles that exist today are listed in [`KNOWN_CYCLES`] (debt, issue 38); a new one fails
//! this test, and so does a listed one that is gone or changed (the list only shrinks). Test
//! code (items under `#[cfg(test)]`), comments and string literals are not read.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Cycles today, each as the sorted files of one strongly connected component (relative to the
/// tree's `src`, prefixed with the tree: `runtime/` or `cli/`). None is left: the last one,
/// `error.rs` naming the retry engine's report, went when the report's plain data moved down
/// beside the errors (`retry_report/`). Kept so that a cycle, if one must be tolerated again,
/// is listed here and can only shrink.
const KNOWN_CYCLES: &[&[&str]] = &[];

/// A module path (`["retry", "report"]`) relative to its crate's root.
type ModPath = Vec<String>;

/// What a `use` in a module makes a name stand for.
#[derive(Clone, Debug)]
enum Alias {
    /// An item or module of this crate, by its absolute path.
    Internal(ModPath),
    /// Something of another crate (`std`, a dependency).
    External,
}

/// One crate's source tree: its files by module path, each file's code and aliases.
struct Tree {
    /// Name used in reports (`runtime`, `cli`).
    name: &'static str,
    files: BTreeMap<ModPath, ModFile>,
}

struct ModFile {
    /// Path relative to `src`.
    rel: String,
    /// The code with comments, string literals and `#[cfg(test)]` items blanked out (line
    /// breaks kept, so offsets still give lines).
    code: String,
    /// Names brought into the module by `use` (glob imports are not followed).
    aliases: BTreeMap<String, Alias>,
}

/// Blanks out comments, string and char literals, keeping every line break.
fn strip_comments_and_strings(code: &str) -> String {
    let c: Vec<char> = code.chars().collect();
    let mut out = String::with_capacity(code.len());
    let blank = |out: &mut String, ch: char| out.push(if ch == '\n' { '\n' } else { ' ' });
    let mut i = 0;
    while i < c.len() {
        let next = c.get(i + 1).copied();
        if c[i] == '/' && next == Some('/') {
            while i < c.len() && c[i] != '\n' {
                out.push(' ');
                i += 1;
            }
        } else if c[i] == '/' && next == Some('*') {
            let mut depth = 0;
            while i < c.len() {
                if c[i] == '/' && c.get(i + 1) == Some(&'*') {
                    depth += 1;
                    out.push_str("  ");
                    i += 2;
                } else if c[i] == '*' && c.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    out.push_str("  ");
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    blank(&mut out, c[i]);
                    i += 1;
                }
            }
        } else if c[i] == 'r'
            && (next == Some('"') || next == Some('#'))
            && (i == 0 || !(c[i - 1].is_alphanumeric() || c[i - 1] == '_'))
            && c[i + 1..].iter().find(|&&x| x != '#') == Some(&'"')
        {
            // a raw string: r#"…"#
            let hashes = c[i + 1..].iter().take_while(|&&x| x == '#').count();
            let start = i;
            i += 2 + hashes;
            while i < c.len() {
                if c[i] == '"'
                    && c[i + 1..]
                        .iter()
                        .take(hashes)
                        .filter(|&&x| x == '#')
                        .count()
                        == hashes
                {
                    i += 1 + hashes;
                    break;
                }
                i += 1;
            }
            for &ch in &c[start..i.min(c.len())] {
                blank(&mut out, ch);
            }
        } else if c[i] == '"' {
            out.push(' ');
            i += 1;
            while i < c.len() && c[i] != '"' {
                if c[i] == '\\' {
                    blank(&mut out, c[i]);
                    i += 1;
                }
                if i < c.len() {
                    blank(&mut out, c[i]);
                    i += 1;
                }
            }
            out.push(' ');
            i += 1;
        } else if c[i] == '\'' && next == Some('\\') {
            // an escaped char literal: '\n', '\u{..}'
            out.push(' ');
            i += 2;
            while i < c.len() && c[i] != '\'' {
                out.push(' ');
                i += 1;
            }
            out.push(' ');
            i += 1;
        } else if c[i] == '\'' && c.get(i + 2) == Some(&'\'') {
            // a char literal ('{'); a lifetime ('a) has no closing quote
            out.push_str("   ");
            i += 3;
        } else {
            out.push(c[i]);
            i += 1;
        }
    }
    out
}

/// Blanks out every item under `#[cfg(test)]` (a `mod tests { … }`, a test-only function or
/// static), keeping line breaks. Expects comments and strings already blanked.
fn strip_test_items(code: &str) -> String {
    const ATTR: &str = "#[cfg(test)]";
    let mut out = code.to_string();
    let mut from = 0;
    while let Some(at) = out[from..].find(ATTR).map(|i| i + from) {
        // the item ends at its first `;` outside braces, or where its first brace closes
        let mut depth = 0usize;
        let mut end = out.len();
        for (j, ch) in out[at + ATTR.len()..].char_indices() {
            match ch {
                '{' => depth += 1,
                '}' => {
                    depth = depth.saturating_sub(1);
                    if depth == 0 {
                        end = at + ATTR.len() + j + 1;
                        break;
                    }
                }
                ';' if depth == 0 => {
                    end = at + ATTR.len() + j + 1;
                    break;
                }
                _ => {}
            }
        }
        let blanked: String = out[at..end]
            .chars()
            .map(|ch| if ch == '\n' { '\n' } else { ' ' })
            .collect();
        out.replace_range(at..end, &blanked);
        from = end;
    }
    out
}

/// Every path a code text names from `at` on, expanded over `{…}` groups: for
/// `crate::a::{b, c::{d, self}}` that is `crate::a::b`, `crate::a::c::d`, `crate::a::c`. A
/// glob ends in a `*` segment. Returns the paths and the offset after them.
fn read_path_tree(code: &str, at: usize) -> (Vec<Vec<String>>, usize) {
    let b = code.as_bytes();
    let mut i = at;
    let skip_ws = |i: &mut usize| {
        while *i < b.len() && b[*i].is_ascii_whitespace() {
            *i += 1;
        }
    };
    let mut prefix = Vec::new();
    loop {
        skip_ws(&mut i);
        if i < b.len() && b[i] == b'{' {
            // a group: each item is a path tree of its own
            i += 1;
            let mut out = Vec::new();
            loop {
                skip_ws(&mut i);
                if i >= b.len() {
                    return (out, i);
                }
                if b[i] == b'}' {
                    return (out, i + 1);
                }
                if b[i] == b',' {
                    i += 1;
                    continue;
                }
                let (subs, j) = read_path_tree(code, i);
                if j == i {
                    // not a path (unexpected text): give up on the group
                    return (out, i + 1);
                }
                for s in subs {
                    let mut p = prefix.clone();
                    if s.first().is_some_and(|x| x == "self") && s.len() == 1 {
                        // `a::{self}` names `a`
                    } else {
                        p.extend(s);
                    }
                    out.push(p);
                }
                i = j;
                skip_ws(&mut i);
                // `Name as Other`
                if code[i..].starts_with("as ") {
                    i += 3;
                    skip_ws(&mut i);
                    while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == b'_') {
                        i += 1;
                    }
                }
            }
        }
        if i < b.len() && b[i] == b'*' {
            prefix.push("*".to_string());
            return (vec![prefix], i + 1);
        }
        let start = i;
        while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == b'_') {
            i += 1;
        }
        if i == start {
            return (
                if prefix.is_empty() {
                    vec![]
                } else {
                    vec![prefix]
                },
                i,
            );
        }
        prefix.push(code[start..i].to_string());
        let mut j = i;
        skip_ws(&mut j);
        if code[j..].starts_with("::") {
            i = j + 2;
        } else {
            return (vec![prefix], i);
        }
    }
}

/// The `use` declarations of a module's code: (the path used, the name it brings in).
fn use_declarations(code: &str) -> Vec<(Vec<String>, String)> {
    let mut out = Vec::new();
    let b = code.as_bytes();
    let mut from = 0;
    while let Some(at) = code[from..].find("use ").map(|i| i + from) {
        from = at + 4;
        let boundary = at == 0 || !(b[at - 1].is_ascii_alphanumeric() || b[at - 1] == b'_');
        if !boundary {
            continue;
        }
        // `use a::{b as c, d};`: read the tree item by item to catch the renames
        let end = code[at..].find(';').map_or(code.len(), |e| at + e);
        let text = &code[at + 4..end];
        let (paths, _) = read_path_tree(text, 0);
        for p in paths {
            // a glob brings no name that could be followed here
            let Some(last) = p.last().cloned().filter(|l| l != "*") else {
                continue;
            };
            out.push((p, last));
        }
        // renames: `X as Y` anywhere in the declaration
        let words: Vec<&str> = text
            .split(|c: char| !(c.is_alphanumeric() || c == '_'))
            .filter(|w| !w.is_empty())
            .collect();
        for w in words.windows(3) {
            if w[1] == "as" && w[2] != "_" {
                if let Some(entry) = out
                    .iter()
                    .rev()
                    .find(|(p, _)| p.last().is_some_and(|l| l == w[0]))
                {
                    let path = entry.0.clone();
                    out.push((path, w[2].to_string()));
                }
            }
        }
        from = end;
    }
    out
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The module path of a file of the tree (`alloc/mod.rs` and `alloc.rs` are `["alloc"]`).
fn module_path(rel: &str) -> ModPath {
    let mut parts: Vec<String> = rel
        .trim_end_matches(".rs")
        .split('/')
        .map(String::from)
        .collect();
    if matches!(parts.last().map(String::as_str), Some("mod" | "lib")) {
        parts.pop();
    }
    parts
}

impl Tree {
    /// Reads the files of `src` whose crate root is `lib.rs` (a binary's `main.rs` is another
    /// crate, which names the library by its name, not through `crate::`).
    fn read(name: &'static str, src: &Path) -> Tree {
        let mut paths = Vec::new();
        rust_files(src, &mut paths);
        let mut sources = Vec::new();
        for p in paths {
            let rel = p
                .strip_prefix(src)
                .unwrap()
                .to_string_lossy()
                .replace('\\', "/");
            if rel == "main.rs" || rel.starts_with("bin/") {
                continue;
            }
            sources.push((rel, std::fs::read_to_string(&p).unwrap()));
        }
        assert!(
            sources.iter().any(|(rel, _)| rel == "lib.rs"),
            "{}: no lib.rs",
            src.display()
        );
        Tree::from_sources(name, sources)
    }

    /// A tree from its files' paths (relative to `src`) and code.
    fn from_sources(name: &'static str, sources: Vec<(String, String)>) -> Tree {
        let mut files = BTreeMap::new();
        for (rel, raw) in sources {
            let code = strip_test_items(&strip_comments_and_strings(&raw));
            files.insert(
                module_path(&rel),
                ModFile {
                    rel,
                    code,
                    aliases: BTreeMap::new(),
                },
            );
        }
        let mut tree = Tree { name, files };
        let mods: Vec<ModPath> = tree.files.keys().cloned().collect();
        for m in mods {
            let decls = use_declarations(&tree.files[&m].code);
            let mut aliases = BTreeMap::new();
            for (path, name) in decls {
                aliases.insert(name, tree.absolute(&m, &path));
            }
            tree.files.get_mut(&m).unwrap().aliases = aliases;
        }
        tree
    }

    /// A path as written in module `m`, made absolute (`External` for other crates).
    fn absolute(&self, m: &ModPath, path: &[String]) -> Alias {
        let mut cur: ModPath = m.clone();
        let mut rest = path;
        match path.first().map(String::as_str) {
            Some("crate") => {
                cur.clear();
                rest = &path[1..];
            }
            Some("self") => rest = &path[1..],
            Some("super") => {
                while rest.first().is_some_and(|s| s == "super") {
                    cur.pop();
                    rest = &rest[1..];
                }
            }
            Some(first) => {
                // relative to `m`: a submodule of `m`, or another crate
                let mut child = m.clone();
                child.push(first.to_string());
                if !self.files.contains_key(&child) {
                    return Alias::External;
                }
            }
            None => return Alias::External,
        }
        cur.extend(rest.iter().cloned());
        Alias::Internal(cur)
    }

    /// The file (module path) that defines what an absolute path names, following re-exports.
    fn resolve(&self, path: &[String], depth: usize) -> Option<ModPath> {
        let mut cur: ModPath = Vec::new();
        for seg in path {
            if seg == "*" {
                return Some(cur);
            }
            let mut child = cur.clone();
            child.push(seg.clone());
            if self.files.contains_key(&child) {
                cur = child;
                continue;
            }
            // an item of `cur`: defined there, or brought in by a `use`
            if depth < 16 {
                match self.files.get(&cur).and_then(|f| f.aliases.get(seg)) {
                    Some(Alias::Internal(p)) if p.as_slice() != path => {
                        return self.resolve(p, depth + 1);
                    }
                    Some(Alias::External) => return None,
                    _ => {}
                }
            }
            return Some(cur);
        }
        Some(cur)
    }

    /// Edges of the file graph: (from, to) module paths, with the first line that names `to`.
    fn edges(&self) -> BTreeMap<(ModPath, ModPath), usize> {
        let mut out = BTreeMap::new();
        for (m, f) in &self.files {
            let b = f.code.as_bytes();
            for prefix in ["crate::", "super::"] {
                let mut from = 0;
                while let Some(at) = f.code[from..].find(prefix).map(|i| i + from) {
                    from = at + prefix.len();
                    let boundary = at == 0
                        || !(b[at - 1].is_ascii_alphanumeric()
                            || b[at - 1] == b'_'
                            || b[at - 1] == b'$'
                            || b[at - 1] == b':');
                    if !boundary {
                        continue;
                    }
                    let line = f.code[..at].matches('\n').count() + 1;
                    let (paths, _) = read_path_tree(&f.code, at);
                    for p in paths {
                        let Alias::Internal(abs) = self.absolute(m, &p) else {
                            continue;
                        };
                        let Some(to) = self.resolve(&abs, 0) else {
                            continue;
                        };
                        // naming itself, or its own submodules (composition), is no edge
                        if to.starts_with(m) {
                            continue;
                        }
                        out.entry((m.clone(), to)).or_insert(line);
                    }
                }
            }
        }
        out
    }

    fn label(&self, m: &ModPath) -> String {
        format!("{}/{}", self.name, self.files[m].rel)
    }
}

/// The strongly connected components of more than one file (Tarjan's algorithm).
fn cycles(nodes: &[ModPath], edges: &BTreeMap<(ModPath, ModPath), usize>) -> Vec<Vec<ModPath>> {
    let index_of: BTreeMap<&ModPath, usize> =
        nodes.iter().enumerate().map(|(i, n)| (n, i)).collect();
    let mut succ = vec![Vec::new(); nodes.len()];
    for (a, b) in edges.keys() {
        if let (Some(&i), Some(&j)) = (index_of.get(a), index_of.get(b)) {
            succ[i].push(j);
        }
    }
    struct State {
        index: Vec<Option<usize>>,
        low: Vec<usize>,
        on_stack: Vec<bool>,
        stack: Vec<usize>,
        next: usize,
        out: Vec<Vec<usize>>,
    }
    fn visit(v: usize, succ: &[Vec<usize>], s: &mut State) {
        s.index[v] = Some(s.next);
        s.low[v] = s.next;
        s.next += 1;
        s.stack.push(v);
        s.on_stack[v] = true;
        for &w in &succ[v] {
            match s.index[w] {
                None => {
                    visit(w, succ, s);
                    s.low[v] = s.low[v].min(s.low[w]);
                }
                Some(iw) if s.on_stack[w] => s.low[v] = s.low[v].min(iw),
                _ => {}
            }
        }
        if Some(s.low[v]) == s.index[v] {
            let mut comp = Vec::new();
            while let Some(w) = s.stack.pop() {
                s.on_stack[w] = false;
                comp.push(w);
                if w == v {
                    break;
                }
            }
            if comp.len() > 1 {
                s.out.push(comp);
            }
        }
    }
    let n = nodes.len();
    let mut s = State {
        index: vec![None; n],
        low: vec![0; n],
        on_stack: vec![false; n],
        stack: Vec::new(),
        next: 0,
        out: Vec::new(),
    };
    for v in 0..n {
        if s.index[v].is_none() {
            visit(v, &succ, &mut s);
        }
    }
    s.out
        .into_iter()
        .map(|c| {
            let mut c: Vec<ModPath> = c.into_iter().map(|i| nodes[i].clone()).collect();
            c.sort();
            c
        })
        .collect()
}

/// One circle through a component, as `a.rs:3 → b.rs:10 → a.rs` (each step's line is where
/// the file names the next).
fn describe(tree: &Tree, comp: &[ModPath], edges: &BTreeMap<(ModPath, ModPath), usize>) -> String {
    let inside: BTreeSet<&ModPath> = comp.iter().collect();
    // shortest way back to the first file, breadth first inside the component
    let start = &comp[0];
    let mut prev: BTreeMap<&ModPath, &ModPath> = BTreeMap::new();
    let mut queue = std::collections::VecDeque::from([start]);
    let mut back = None;
    while let Some(v) = queue.pop_front() {
        for (a, b) in edges.keys().filter(|(a, b)| a == v && inside.contains(b)) {
            if b == start {
                back = Some(a);
                break;
            }
            if !prev.contains_key(b) {
                prev.insert(b, a);
                queue.push_back(b);
            }
        }
        if back.is_some() {
            break;
        }
    }
    let mut chain = Vec::new();
    let mut v = back.expect("a component has a cycle through each file");
    while v != start {
        chain.push(v.clone());
        v = prev[v];
    }
    chain.reverse();
    let way: Vec<ModPath> = std::iter::once(start.clone())
        .chain(chain)
        .chain(std::iter::once(start.clone()))
        .collect();
    let mut text = String::new();
    for pair in way.windows(2) {
        text += &format!(
            "{}:{} → ",
            tree.label(&pair[0]),
            edges[&(pair[0].clone(), pair[1].clone())]
        );
    }
    text + &tree.label(start)
}

/// Every cycle of a tree: the component's sorted files, and one circle through it.
fn tree_cycles(tree: &Tree) -> Vec<(Vec<String>, String)> {
    let edges = tree.edges();
    let nodes: Vec<ModPath> = tree.files.keys().cloned().collect();
    cycles(&nodes, &edges)
        .into_iter()
        .map(|c| {
            let mut files: Vec<String> = c.iter().map(|m| tree.label(m)).collect();
            files.sort();
            (files, describe(tree, &c, &edges))
        })
        .collect()
}

fn trees() -> Vec<Tree> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    vec![
        Tree::read("runtime", &root.join("src")),
        Tree::read("cli", &root.join("../cli/src")),
    ]
}

#[test]
fn no_file_names_a_file_that_names_it_back() {
    let mut found = BTreeSet::new();
    let mut problems = Vec::new();
    for tree in trees() {
        for (files, circle) in tree_cycles(&tree) {
            let known = KNOWN_CYCLES
                .iter()
                .any(|k| k.iter().copied().eq(files.iter().map(String::as_str)));
            if !known {
                problems.push(format!(
                    "a cycle between files: {circle}\n  (all of {files:?} reach each other)"
                ));
            }
            found.insert(files);
        }
    }
    for known in KNOWN_CYCLES {
        let known: Vec<String> = known.iter().map(|s| s.to_string()).collect();
        if !found.contains(&known) {
            problems.push(format!(
                "{known:?} is no longer a cycle as listed: take it off KNOWN_CYCLES (or put what is \
                 left of it there)"
            ));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// A tree of the given files, and its cycles' file lists.
fn cycles_of(files: &[(&str, &str)]) -> Vec<Vec<String>> {
    let sources = files
        .iter()
        .map(|&(rel, code)| (rel.to_string(), code.to_string()))
        .collect();
    let tree = Tree::from_sources("t", sources);
    tree_cycles(&tree).into_iter().map(|(f, _)| f).collect()
}

#[test]
fn a_circle_through_a_re_export_is_found() {
    let files = [
        ("lib.rs", "mod a; mod b; pub use b::B;"),
        // `a` names `B` through the root's re-export: the edge goes to b.rs
        ("a.rs", "pub struct A; fn f(_: crate::B) {}"),
        ("b/mod.rs", "mod inner; pub use inner::B;"),
        (
            "b/inner.rs",
            "use crate::{x::Y, a::{self, A}};\npub struct B(A);",
        ),
    ];
    assert_eq!(
        cycles_of(&files),
        [vec!["t/a.rs".to_string(), "t/b/inner.rs".to_string()]]
    );
    let tree = Tree::from_sources(
        "t",
        files
            .iter()
            .map(|&(r, c)| (r.to_string(), c.to_string()))
            .collect(),
    );
    let (_, circle) = tree_cycles(&tree).remove(0);
    assert_eq!(circle, "t/a.rs:1 → t/b/inner.rs:1 → t/a.rs");
}

#[test]
fn composition_comments_strings_and_tests_are_no_edges() {
    let none: [Vec<String>; 0] = [];
    // a parent names its children and a child its parent: no circle (a parent owns its children)
    let owned = [
        ("lib.rs", "mod a;"),
        (
            "a/mod.rs",
            "mod c; pub struct P; fn f() { c::g(); crate::a::c::g(); }",
        ),
        ("a/c.rs", "pub fn g() { let _ = super::P; }"),
    ];
    assert_eq!(cycles_of(&owned), none);
    // `b` names `a`; `a` names `b` only in comments, strings, after a char literal and in tests
    let hidden = "// crate::b::f\n/* crate::b::f */ const S: &str = \"crate::b::f\";\n\
                  const C: char = '{'; const R: &str = r#\"crate::b::f\"#;\n\
                  #[cfg(test)]\nmod tests { use crate::b::f; }\n\
                  #[cfg(test)]\nfn t() { crate::b::f() }\n";
    let mut files = vec![
        ("lib.rs", "mod a; mod b;"),
        ("a.rs", hidden),
        ("b.rs", "pub fn f() {} fn g(_: &'static crate::a::S) {}"),
    ];
    assert_eq!(cycles_of(&files), none);
    // the same name in code closes the circle
    let named = format!("{hidden}fn h() {{ crate::b::f(); }}");
    files[1].1 = &named;
    assert_eq!(
        cycles_of(&files),
        [vec!["t/a.rs".to_string(), "t/b.rs".to_string()]]
    );
}
