//! The example's output lines: `KIND phase=NAME key=value ...` (one measured figure or event
//! per line, easy to paste), or with `--json` one JSON object per line with the same fields.
//! Scripts (`scripts/gpu-runs/`) and docs/GPU.md read these lines: keep their names and keys.

use std::io::{ErrorKind, Write};

use serde_json::{Map, Number, Value};

/// One output line under construction.
#[derive(Clone, Debug)]
pub struct Line {
    kind: &'static str,
    fields: Vec<(&'static str, Value, String)>,
}

impl Line {
    /// `RESULT`: a measured figure.
    pub fn result(phase: &str) -> Self {
        Self::new("RESULT", phase)
    }

    /// `STEP`: one step inside a phase.
    pub fn step(phase: &str) -> Self {
        Self::new("STEP", phase)
    }

    /// `TRIAL`: one probe of a search, or one candidate timed by hand (`oom`'s splits).
    pub fn trial(phase: &str) -> Self {
        Self::new("TRIAL", phase)
    }

    /// `CONFIG`: the run's shape and options (no phase).
    pub fn config() -> Self {
        Self {
            kind: "CONFIG",
            fields: Vec::new(),
        }
    }

    /// `PHASE`: how a phase ended.
    pub fn phase(phase: &str) -> Self {
        Self::new("PHASE", phase)
    }

    fn new(kind: &'static str, phase: &str) -> Self {
        Self {
            kind,
            fields: vec![("phase", Value::from(phase), phase.to_string())],
        }
    }

    /// An integer.
    pub fn int(mut self, key: &'static str, v: impl Into<i64>) -> Self {
        let v = v.into();
        self.fields.push((key, Value::from(v), v.to_string()));
        self
    }

    /// A boolean.
    pub fn flag(mut self, key: &'static str, v: bool) -> Self {
        self.fields.push((key, Value::from(v), v.to_string()));
        self
    }

    /// A float printed with `digits` decimals (`{:.e}` when `digits` is 0); NaN and
    /// infinities are `null` in JSON.
    pub fn float(mut self, key: &'static str, v: f64, digits: usize) -> Self {
        let text = if digits == 0 {
            format!("{v:.3e}")
        } else {
            format!("{v:.digits$}")
        };
        let json = Number::from_f64(v).map_or(Value::Null, Value::Number);
        self.fields.push((key, json, text));
        self
    }

    /// A string (spaces become `_` in the text form, so a line splits on spaces).
    pub fn text(mut self, key: &'static str, v: impl Into<String>) -> Self {
        let v: String = v.into();
        let t = v.replace(char::is_whitespace, "_");
        self.fields.push((key, Value::from(v), t));
        self
    }

    /// The line as printed: `KIND key=value ...`, or with `json` one JSON object (its `kind`
    /// and the fields).
    pub fn render(&self, json: bool) -> String {
        if json {
            let mut m = Map::new();
            m.insert("kind".into(), Value::from(self.kind));
            for (k, v, _) in &self.fields {
                m.insert((*k).into(), v.clone());
            }
            Value::Object(m).to_string()
        } else {
            let mut s = self.kind.to_string();
            for (k, _, t) in &self.fields {
                s.push(' ');
                s.push_str(k);
                s.push('=');
                s.push_str(t);
            }
            s
        }
    }

    /// Prints the line on stdout.
    pub fn emit(self, json: bool) {
        crate::say!("{}", self.render(json));
    }
}

/// `println!` that ends the process quietly (status 0) once stdout is a closed pipe (`| head`),
/// where `println!` panics; any other failure to write ends it with status 74 (`EX_IOERR`).
#[macro_export]
macro_rules! say {
    ($($t:tt)*) => {
        if let Err(code) = $crate::report::write_line(&mut ::std::io::stdout(), format_args!($($t)*)) {
            ::std::process::exit(code)
        }
    };
}

/// [`say!`]'s body: writes the line; `Err` is the exit status to end with.
pub fn write_line(out: &mut dyn Write, text: std::fmt::Arguments<'_>) -> Result<(), i32> {
    match writeln!(out, "{text}").and_then(|()| out.flush()) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == ErrorKind::BrokenPipe => Err(0),
        Err(e) => {
            eprintln!("stdout: {e}");
            Err(74)
        }
    }
}

/// The first line of `s`, at most 200 characters.
pub fn one_line(s: &str) -> String {
    s.lines().next().unwrap_or("").chars().take(200).collect()
}

/// The median of `v` (NaN when empty).
pub fn median(v: &mut [f64]) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stdout whose reader is gone, or whose disk is full.
    struct Failing(ErrorKind);

    impl Write for Failing {
        fn write(&mut self, _: &[u8]) -> std::io::Result<usize> {
            Err(self.0.into())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_closed_pipe_ends_quietly_other_write_errors_do_not() {
        let mut v = Vec::new();
        assert_eq!(write_line(&mut v, format_args!("PHASE {}", 1)), Ok(()));
        assert_eq!(v, b"PHASE 1\n");
        let closed = write_line(&mut Failing(ErrorKind::BrokenPipe), format_args!("x"));
        assert_eq!(closed, Err(0));
        let full = write_line(&mut Failing(ErrorKind::StorageFull), format_args!("x"));
        assert_eq!(full, Err(74));
    }
}
