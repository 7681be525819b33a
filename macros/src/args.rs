//! Parsing attribute arguments: `key = value` pairs, bare flags and one leading literal, each
//! kept with its span so that every later error points at its token.

use proc_macro2::{Span, TokenStream};
use syn::parse::{Parse, ParseStream, Parser};
use syn::punctuated::Punctuated;
use syn::{Expr, Ident, Lit, LitStr, Token};

/// One argument: `key = value`, a bare `key`, or a literal.
pub enum Arg {
    /// `key = value`
    KeyValue { key: Ident, value: Expr },
    /// `key` alone
    Flag(Ident),
    /// `"2 GiB"`
    Literal(Lit),
    /// Any other expression (`self.budget`), reported by each attribute with what it expects.
    Expr(Expr),
}

impl Parse for Arg {
    fn parse(input: ParseStream<'_>) -> syn::Result<Self> {
        if input.peek(Lit) && (input.peek2(Token![,]) || peek2_end(input)) {
            return Ok(Arg::Literal(input.parse()?));
        }
        // `crate` is a keyword: accept it as an option name, as tokio does.
        let key = if input.peek(Token![crate]) && input.peek2(Token![=]) {
            let kw: Token![crate] = input.parse()?;
            Ident::new("crate", kw.span)
        } else if input.peek(Ident)
            && (input.peek2(Token![=]) || input.peek2(Token![,]) || peek2_end(input))
        {
            input.parse::<Ident>()?
        } else {
            return Ok(Arg::Expr(input.parse()?));
        };
        if input.peek(Token![=]) {
            input.parse::<Token![=]>()?;
            Ok(Arg::KeyValue {
                key,
                value: input.parse()?,
            })
        } else {
            Ok(Arg::Flag(key))
        }
    }
}

/// Whether the token after the next one is the end of the input.
fn peek2_end(input: ParseStream<'_>) -> bool {
    let fork = input.fork();
    fork.parse::<proc_macro2::TokenTree>().is_ok() && fork.is_empty()
}

/// Parses the tokens inside `#[attr(...)]`.
pub fn parse_args(tokens: TokenStream) -> syn::Result<Vec<Arg>> {
    let list = Punctuated::<Arg, Token![,]>::parse_terminated.parse2(tokens)?;
    Ok(list.into_iter().collect())
}

/// Collects errors so that one expansion reports all of them.
#[derive(Default)]
pub struct Errors(Option<syn::Error>);

impl Errors {
    pub fn push(&mut self, e: syn::Error) {
        match &mut self.0 {
            Some(all) => all.combine(e),
            None => self.0 = Some(e),
        }
    }
    pub fn at<T: quote::ToTokens>(&mut self, tokens: T, msg: impl std::fmt::Display) {
        self.push(syn::Error::new_spanned(tokens, msg));
    }
    pub fn at_span(&mut self, span: Span, msg: impl std::fmt::Display) {
        self.push(syn::Error::new(span, msg));
    }
    pub fn finish(self) -> Option<syn::Error> {
        self.0
    }
}

/// Tracks which keys were seen, to report duplicates at the second occurrence.
pub struct Seen(Vec<String>);

impl Seen {
    pub fn new() -> Self {
        Seen(Vec::new())
    }
    /// `false` (and an error) when `key` was already given.
    pub fn first(&mut self, key: &Ident, errors: &mut Errors) -> bool {
        let k = key.to_string();
        if self.0.contains(&k) {
            errors.at(key, format!("duplicate option `{k}`"));
            return false;
        }
        self.0.push(k);
        true
    }
}

/// The expression as an integer literal.
pub fn int_lit(e: &Expr, what: &str, errors: &mut Errors) -> Option<u64> {
    if let Expr::Lit(syn::ExprLit {
        lit: Lit::Int(i), ..
    }) = e
    {
        // as rustc reads the literal: its suffix a type, its value within it
        let most = match i.suffix() {
            "" | "u64" | "usize" | "u128" | "i128" => u64::MAX,
            "u8" => u8::MAX.into(),
            "u16" => u16::MAX.into(),
            "u32" => u32::MAX.into(),
            "i8" => i8::MAX as u64,
            "i16" => i16::MAX as u64,
            "i32" => i32::MAX as u64,
            "i64" | "isize" => i64::MAX as u64,
            other => {
                errors.at(
                    i,
                    format!("`{other}` is not an integer type (`{what} = 4`)"),
                );
                return None;
            }
        };
        match i.base10_parse::<u64>() {
            Ok(n) if n <= most => return Some(n),
            Ok(n) => errors.at(i, format!("{n} does not fit in `{}`", i.suffix())),
            Err(err) => errors.push(err),
        }
        return None;
    }
    errors.at(
        e,
        format!("`{what}` takes an integer literal, e.g. `{what} = 4`"),
    );
    None
}

/// The expression as a `true`/`false` literal.
pub fn bool_lit(e: &Expr, what: &str, errors: &mut Errors) -> Option<bool> {
    if let Expr::Lit(syn::ExprLit {
        lit: Lit::Bool(b), ..
    }) = e
    {
        return Some(b.value);
    }
    errors.at(e, format!("`{what}` takes `true` or `false`"));
    None
}

/// The expression as a string literal.
pub fn str_lit(e: &Expr, what: &str, errors: &mut Errors) -> Option<LitStr> {
    if let Expr::Lit(syn::ExprLit {
        lit: Lit::Str(s), ..
    }) = e
    {
        return Some(s.clone());
    }
    errors.at(
        e,
        format!("`{what}` takes a string literal, e.g. `{what} = \"...\"`"),
    );
    None
}

/// The expression as a single identifier.
pub fn ident(e: &Expr, what: &str, errors: &mut Errors) -> Option<Ident> {
    if let Expr::Path(p) = e {
        if let Some(id) = p.path.get_ident() {
            return Some(id.clone());
        }
    }
    errors.at(
        e,
        format!("`{what}` takes a parameter name, e.g. `{what} = batch_size`"),
    );
    None
}

/// A byte size literal ("2 GiB"), parsed as the runtime parses sizes.
pub fn size_lit(s: &LitStr, errors: &mut Errors) -> Option<u64> {
    match s.value().parse::<oomguard_runtime::ByteSize>() {
        Ok(b) => Some(b.bytes()),
        Err(e) => {
            errors.at(s, e);
            None
        }
    }
}

/// `crate = "path"`: the path of the oomguard facade, for renamed dependencies.
pub fn crate_path(e: &Expr, errors: &mut Errors) -> Option<syn::Path> {
    let s = str_lit(e, "crate", errors)?;
    match s.parse::<syn::Path>() {
        Ok(p) => Some(p),
        Err(_) => {
            errors.at(&s, format!("`{}` is not a path", s.value()));
            None
        }
    }
}

/// The error for an option the attribute does not know, listing the valid ones.
pub fn unknown(key: &Ident, attr: &str, valid: &[&str], errors: &mut Errors) {
    errors.at(
        key,
        format!(
            "unknown option `{key}` for #[{attr}]; valid options: {}",
            valid.join(", ")
        ),
    );
}
