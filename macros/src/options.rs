//! The options of each attribute, built from parsed arguments; every problem is reported at its
//! token.

use proc_macro2::Span;
use syn::{Expr, Ident, Lit, LitStr};

use crate::args::{self, Arg, Errors, Seen};

/// `#[oom_retry(...)]`
#[derive(Default)]
pub struct RetryOptions {
    pub batch: Option<Ident>,
    pub plan: Option<Ident>,
    pub policy: Option<Expr>,
    pub min: Option<u64>,
    pub max_retries: Option<u64>,
    pub remember: Option<bool>,
    pub persist: Option<LitStr>,
    /// `commit = |value| ...`: the commit phase, run once with the successful attempt's value.
    pub commit: Option<Expr>,
    pub krate: Option<syn::Path>,
}

const RETRY_KEYS: &[&str] = &[
    "batch",
    "plan",
    "policy",
    "min",
    "max_retries",
    "remember",
    "persist",
    "commit",
    "crate",
];

impl RetryOptions {
    pub fn from_args(list: Vec<Arg>, errors: &mut Errors) -> Self {
        let mut o = RetryOptions::default();
        let mut seen = Seen::new();
        let mut min_at: Option<Ident> = None;
        for arg in list {
            let (key, value) = match arg {
                Arg::KeyValue { key, value } => (key, value),
                Arg::Flag(key) => {
                    if RETRY_KEYS.contains(&key.to_string().as_str()) {
                        errors.at(&key, format!("`{key}` needs a value: `{key} = ...`"));
                    } else {
                        args::unknown(&key, "oom_retry", RETRY_KEYS, errors);
                    }
                    continue;
                }
                Arg::Literal(l) => {
                    errors.at(l, "#[oom_retry] takes `key = value` options");
                    continue;
                }
                Arg::Expr(e) => {
                    errors.at(e, "#[oom_retry] takes `key = value` options");
                    continue;
                }
            };
            if !RETRY_KEYS.contains(&key.to_string().as_str()) {
                args::unknown(&key, "oom_retry", RETRY_KEYS, errors);
                continue;
            }
            if !seen.first(&key, errors) {
                continue;
            }
            match key.to_string().as_str() {
                "batch" => o.batch = args::ident(&value, "batch", errors),
                "plan" => o.plan = args::ident(&value, "plan", errors),
                "policy" => o.policy = Some(value),
                "min" => {
                    min_at = Some(key.clone());
                    o.min = args::int_lit(&value, "min", errors);
                    if o.min == Some(0) {
                        errors.at(&value, "`min` must be at least 1");
                    }
                }
                "max_retries" => o.max_retries = args::int_lit(&value, "max_retries", errors),
                "remember" => o.remember = args::bool_lit(&value, "remember", errors),
                "persist" => {
                    o.persist = args::str_lit(&value, "persist", errors);
                    if o.persist.as_ref().is_some_and(|p| p.value().is_empty()) {
                        errors.at(&value, "`persist` needs a file path");
                    }
                }
                "commit" => o.commit = commit_closure(value, errors),
                "crate" => o.krate = args::crate_path(&value, errors),
                _ => unreachable!("keys are checked above"),
            }
        }
        if let (Some(at), None, None, None) = (&min_at, &o.batch, &o.plan, &o.policy) {
            errors.at(
                at,
                "`min` is the smallest batch (`batch = ...`) or micro-batch (`plan = ...`): give one of them, or a `policy`",
            );
        }
        if let (Some(p), Some(false)) = (&o.persist, o.remember) {
            errors.at(
                p,
                "`persist` saves remembered plans, and `remember = false` remembers none: drop one",
            );
        }
        if let (Some(b), Some(_)) = (&o.batch, &o.plan) {
            errors.at(
                b,
                "give `batch` (shrink the batch) or `plan` (accumulate micro-batches), not both",
            );
        }
        o
    }
}

/// `commit = |value| body`: a closure of one parameter (the attempt's value), run once after an
/// attempt succeeded. It is pasted after the retry loop, so it may use the function's
/// parameters (`self` included) and must return the function's return type.
fn commit_closure(value: Expr, errors: &mut Errors) -> Option<Expr> {
    let Expr::Closure(c) = &value else {
        errors.at(
            &value,
            "`commit` takes a closure of one parameter, the attempt's value: \
             `commit = |grads| self.apply(grads)`",
        );
        return None;
    };
    if c.inputs.len() != 1 {
        let at = if c.inputs.is_empty() {
            quote::quote!(#c)
        } else {
            let i = &c.inputs;
            quote::quote!(#i)
        };
        errors.at(
            at,
            format!(
                "the `commit` closure takes exactly one parameter (the value the body returned), not {}",
                c.inputs.len()
            ),
        );
        return None;
    }
    if let Some(a) = &c.asyncness {
        errors.at(
            a,
            "the `commit` closure cannot be `async`: it runs once, after the attempt",
        );
        return None;
    }
    Some(value)
}

/// What a budget is.
pub enum BudgetLimit {
    Bytes(u64),
    Expr(Expr),
    Fraction(f64),
}

/// `#[memory_budget(...)]`
pub struct BudgetOptions {
    pub limit: Option<BudgetLimit>,
    pub krate: Option<syn::Path>,
}

const BUDGET_KEYS: &[&str] = &["bytes", "fraction", "crate"];

impl BudgetOptions {
    pub fn from_args(list: Vec<Arg>, span: Span, errors: &mut Errors) -> Self {
        let mut o = BudgetOptions {
            limit: None,
            krate: None,
        };
        let mut seen = Seen::new();
        let mut limit_given = false;
        let set_limit = |o: &mut BudgetOptions,
                         l: BudgetLimit,
                         at: &dyn quote::ToTokens,
                         errors: &mut Errors| {
            if o.limit.is_some() {
                errors.at(
                    at,
                    "give the budget once: a size literal, `bytes = ...` or `fraction = ...`",
                );
            } else {
                o.limit = Some(l);
            }
        };
        for arg in list {
            match &arg {
                Arg::Literal(_) => limit_given = true,
                Arg::KeyValue { key, .. } if key == "bytes" || key == "fraction" => {
                    limit_given = true
                }
                _ => {}
            }
            match arg {
                Arg::Literal(Lit::Str(s)) => match args::size_lit(&s, errors) {
                    Some(0) => errors.at(&s, "a budget of 0 bytes allows no allocation at all"),
                    Some(n) => set_limit(&mut o, BudgetLimit::Bytes(n), &s, errors),
                    None => {}
                },
                Arg::Literal(Lit::Int(i)) => errors.at(
                    &i,
                    format!(
                        "the budget literal is a size string such as \"2 GiB\"; a number of \
                         bytes is `bytes = {}`",
                        i.base10_digits()
                    ),
                ),
                Arg::Literal(l) => {
                    errors.at(l, "the budget literal is a size string such as \"2 GiB\"")
                }
                Arg::Flag(key) if BUDGET_KEYS.contains(&key.to_string().as_str()) => {
                    limit_given = true;
                    let example = match key.to_string().as_str() {
                        "bytes" => "bytes = expr",
                        "fraction" => "fraction = 0.9",
                        _ => "crate = \"path\"",
                    };
                    errors.at(&key, format!("`{key}` needs a value: {example}"))
                }
                Arg::Flag(key) => {
                    limit_given = true;
                    errors.at(
                        &key,
                        format!("a budget computed at run time is `bytes = {key}`; a fixed one is a size literal such as \"2 GiB\" (options: bytes, fraction, crate)"),
                    )
                }
                Arg::Expr(e) => {
                    limit_given = true;
                    let shown = quote::quote!(#e).to_string().replace(" . ", ".");
                    errors.at(
                        &e,
                        format!("a budget computed at run time is `bytes = {shown}`; a fixed one is a size literal such as \"2 GiB\""),
                    )
                }
                Arg::KeyValue { key, value } => {
                    if !BUDGET_KEYS.contains(&key.to_string().as_str()) {
                        args::unknown(&key, "memory_budget", BUDGET_KEYS, errors);
                        // (a misspelt `bytes`/`fraction` is said once, not again as no budget)
                        limit_given = true;
                        continue;
                    }
                    if !seen.first(&key, errors) {
                        continue;
                    }
                    match key.to_string().as_str() {
                        "bytes" => {
                            if let Expr::Lit(syn::ExprLit {
                                lit: Lit::Int(i), ..
                            }) = &value
                            {
                                if i.base10_parse::<u64>().ok() == Some(0) {
                                    errors.at(
                                        &value,
                                        "a budget of 0 bytes allows no allocation at all",
                                    );
                                    continue;
                                }
                            }
                            set_limit(&mut o, BudgetLimit::Expr(value.clone()), &key, errors)
                        }
                        "fraction" => {
                            let f = match &value {
                                Expr::Lit(syn::ExprLit {
                                    lit: Lit::Float(f), ..
                                }) if matches!(f.suffix(), "" | "f32" | "f64") => {
                                    f.base10_parse::<f64>().ok()
                                }
                                Expr::Lit(syn::ExprLit {
                                    lit: Lit::Int(i), ..
                                }) if i.suffix().is_empty() => i.base10_parse::<f64>().ok(),
                                _ => None,
                            };
                            match f {
                                // below 2^-53 the runtime cannot tell it from 0
                                Some(f) if f > 0.0 && f <= 1.0 && f * 2f64.powi(53) >= 0.5 => {
                                    set_limit(&mut o, BudgetLimit::Fraction(f), &key, errors)
                                }
                                Some(f) if f > 0.0 && f <= 1.0 => errors.at(
                                    &value,
                                    format!("`fraction` {f:e} is below 2^-53, the smallest a budget tells from 0; give `bytes = ...`"),
                                ),
                                Some(f) => errors.at(&value, format!("`fraction` must be in (0, 1], not {f}")),
                                None => errors.at(&value, "`fraction` takes a number literal in (0, 1], e.g. `fraction = 0.9`"),
                            }
                        }
                        "crate" => o.krate = args::crate_path(&value, errors),
                        _ => unreachable!("keys are checked above"),
                    }
                }
            }
        }
        if !limit_given {
            errors.at_span(
                span,
                "#[memory_budget] needs a budget: #[memory_budget(\"2 GiB\")], #[memory_budget(bytes = expr)] or #[memory_budget(fraction = 0.9)]",
            );
        }
        o
    }
}

/// What a leak check does with leaks.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum LeakAction {
    Panic,
    Warn,
    Error,
}

/// `#[leak_check(...)]`
pub struct LeakOptions {
    pub action: LeakAction,
    pub action_span: Option<Span>,
    pub allow: u64,
    pub krate: Option<syn::Path>,
}

const LEAK_KEYS: &[&str] = &["action", "allow", "crate"];

impl LeakOptions {
    pub fn from_args(list: Vec<Arg>, errors: &mut Errors) -> Self {
        let mut o = LeakOptions {
            action: LeakAction::Panic,
            action_span: None,
            allow: 0,
            krate: None,
        };
        let mut seen = Seen::new();
        for arg in list {
            let (key, value) = match arg {
                Arg::KeyValue { key, value } => (key, value),
                Arg::Flag(key) if LEAK_KEYS.contains(&key.to_string().as_str()) => {
                    let example = match key.to_string().as_str() {
                        "action" => "action = warn (panic, warn or error)",
                        "allow" => "allow = \"1 MiB\"",
                        _ => "crate = \"path\"",
                    };
                    errors.at(&key, format!("`{key}` needs a value: {example}"));
                    continue;
                }
                Arg::Flag(key) => {
                    args::unknown(&key, "leak_check", LEAK_KEYS, errors);
                    continue;
                }
                Arg::Literal(l) => {
                    errors.at(
                        l,
                        "#[leak_check] takes `action = ...` and `allow = \"size\"`",
                    );
                    continue;
                }
                Arg::Expr(e) => {
                    errors.at(
                        e,
                        "#[leak_check] takes `action = ...` and `allow = \"size\"`",
                    );
                    continue;
                }
            };
            if !LEAK_KEYS.contains(&key.to_string().as_str()) {
                args::unknown(&key, "leak_check", LEAK_KEYS, errors);
                continue;
            }
            if !seen.first(&key, errors) {
                continue;
            }
            match key.to_string().as_str() {
                "action" => {
                    if let Expr::Lit(syn::ExprLit {
                        lit: Lit::Str(text),
                        ..
                    }) = &value
                    {
                        errors.at(
                            &value,
                            format!(
                                "`action` takes `panic`, `warn` or `error` without quotes: `action = {}`",
                                text.value()
                            ),
                        );
                        continue;
                    }
                    let Some(id) = action_ident(&value, errors) else {
                        continue;
                    };
                    o.action_span = Some(id.span());
                    o.action = match id.to_string().as_str() {
                        "panic" => LeakAction::Panic,
                        "warn" => LeakAction::Warn,
                        "error" => LeakAction::Error,
                        other => {
                            errors.at(
                                &id,
                                format!("unknown action `{other}`; use panic, warn or error"),
                            );
                            continue;
                        }
                    };
                }
                "allow" => {
                    if let Some(s) = args::str_lit(&value, "allow", errors) {
                        o.allow = args::size_lit(&s, errors).unwrap_or(0);
                    }
                }
                "crate" => o.krate = args::crate_path(&value, errors),
                _ => unreachable!("keys are checked above"),
            }
        }
        o
    }
}

/// The `action` value: `panic`, `warn` or `error`.
fn action_ident(e: &Expr, errors: &mut Errors) -> Option<Ident> {
    if let Expr::Path(p) = e {
        if let Some(id) = p.path.get_ident() {
            return Some(id.clone());
        }
    }
    errors.at(e, "`action` takes `panic`, `warn` or `error`");
    None
}

/// `#[no_grad]` takes only `crate = "path"`.
pub fn no_grad_options(list: Vec<Arg>, errors: &mut Errors) -> Option<syn::Path> {
    let mut krate = None;
    let mut seen = Seen::new();
    for arg in list {
        match arg {
            Arg::KeyValue { key, value } if key == "crate" => {
                if seen.first(&key, errors) {
                    krate = args::crate_path(&value, errors);
                }
            }
            Arg::KeyValue { key, .. } | Arg::Flag(key) => {
                args::unknown(&key, "no_grad", &["crate"], errors)
            }
            Arg::Literal(l) => {
                errors.at(l, "#[no_grad] takes no arguments (only `crate = \"path\"`)")
            }
            Arg::Expr(e) => errors.at(e, "#[no_grad] takes no arguments (only `crate = \"path\"`)"),
        }
    }
    krate
}
