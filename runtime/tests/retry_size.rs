//! Size and shape of the retry engine's source (`runtime/src/retry/`): no file over
//! [`MAX_FILE_LINES`] lines, no `fn` over [`MAX_FN_LINES`] lines (from its `fn` line to its
//! closing brace). Cycles between files, `retry/`'s included, are `cycles.rs`'s check.
//!
//! The scanner is a small lexer: comments, string literals (raw and byte strings too) and char
//! literals are blanked before braces are matched, so a `{` in a message or a doc comment counts
//! for nothing.

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
