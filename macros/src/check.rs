//! Checks of the annotated function, and what the expansions need to know about it.

use syn::{FnArg, Ident, ItemFn, Pat, ReturnType, Type};

use crate::args::Errors;

/// How a parameter is passed, which decides how each retry attempt gets it again.
pub enum Passing {
    /// `&T`: passed again as is.
    SharedRef,
    /// `&mut T`: reborrowed for each attempt.
    MutRef,
    /// By value: cloned for each attempt (must be `Clone`).
    Value,
}

/// A parameter other than the receiver.
pub struct Param {
    pub ident: Option<Ident>,
    pub pat: Box<Pat>,
    pub ty: Box<Type>,
    pub passing: Passing,
}

/// The parameters of `f`, with their passing.
pub fn params(f: &ItemFn) -> Vec<Param> {
    f.sig
        .inputs
        .iter()
        .filter_map(|a| match a {
            FnArg::Typed(t) => Some(t),
            FnArg::Receiver(_) => None,
        })
        .map(|t| {
            let ident = match &*t.pat {
                Pat::Ident(pi) if pi.subpat.is_none() => Some(pi.ident.clone()),
                _ => None,
            };
            let passing = match &*t.ty {
                Type::Reference(r) if r.mutability.is_some() => Passing::MutRef,
                Type::Reference(_) => Passing::SharedRef,
                _ => Passing::Value,
            };
            Param {
                ident,
                pat: t.pat.clone(),
                ty: t.ty.clone(),
                passing,
            }
        })
        .collect()
}

/// Rejects `const fn` (guards run code at run time).
pub fn not_const(f: &ItemFn, attr: &str, errors: &mut Errors) {
    if let Some(c) = &f.sig.constness {
        errors.at(c, format!("#[{attr}] cannot be used on a `const fn`"));
    }
}

/// Rejects a function that is not `async` but returns `impl Future`: a guard would hold only
/// while the call makes the future, not while the future runs (an `async fn`'s guards hold on
/// every poll).
pub fn not_impl_future(f: &ItemFn, attr: &str, errors: &mut Errors) {
    if f.sig.asyncness.is_some() {
        return;
    }
    if let ReturnType::Type(_, ty) = &f.sig.output {
        if let syn::Type::ImplTrait(it) = &**ty {
            let future = it.bounds.iter().any(|b| {
                matches!(b, syn::TypeParamBound::Trait(t)
                    if t.path.segments.last().is_some_and(|s| s.ident == "Future"))
            });
            if future {
                errors.at(
                    ty,
                    format!(
                        "#[{attr}] on a function that returns `impl Future` would guard only the \
                         call that makes the future, not the future's work: write it as an \
                         `async fn` (its guards hold on every poll)"
                    ),
                );
            }
        }
    }
}

/// The `Result` return type, or an error at the return type.
pub fn require_result(f: &ItemFn, attr: &str, why: &str, errors: &mut Errors) -> bool {
    match &f.sig.output {
        ReturnType::Type(_, ty) if is_result(ty) => true,
        ReturnType::Type(_, ty) => {
            errors.at(
                ty,
                format!("#[{attr}] {why}: the function must return a `Result`"),
            );
            false
        }
        ReturnType::Default => {
            errors.at(
                &f.sig.ident,
                format!("#[{attr}] {why}: the function must return a `Result`"),
            );
            false
        }
    }
}

/// Whether the type may be a `Result`: `Result<..>` under any path, or a type alias (any other
/// path but the well-known types that are not one). An alias that is not a `Result` is reported
/// by the compiler through `__private::FnResult`.
fn is_result(ty: &Type) -> bool {
    const NOT_RESULT: &[&str] = &[
        "bool", "char", "str", "String", "Option", "Vec", "Box", "usize", "u8", "u16", "u32",
        "u64", "u128", "isize", "i8", "i16", "i32", "i64", "i128", "f32", "f64", "Self",
    ];
    match ty {
        Type::Path(p) => p
            .path
            .segments
            .last()
            .is_some_and(|s| !NOT_RESULT.contains(&s.ident.to_string().as_str())),
        Type::Group(g) => is_result(&g.elem),
        Type::Paren(p) => is_result(&p.elem),
        _ => false,
    }
}

/// Rejects a by-value `self` on a retried function (it cannot be passed to a second attempt).
pub fn no_value_self(f: &ItemFn, errors: &mut Errors) {
    for a in &f.sig.inputs {
        if let FnArg::Receiver(r) = a {
            if r.reference.is_none() && !matches!(&*r.ty, Type::Reference(_)) {
                errors.at(
                    r,
                    "#[oom_retry] cannot retry a method that takes `self` by value: a failed attempt would consume it; take `&self` or `&mut self`",
                );
            }
        }
    }
}

/// Whether a type is one of the unsigned integers `batch =` takes (a row count: never negative;
/// `u128` is more than any batch).
pub fn is_batch_integer(ty: &Type) -> bool {
    const INTS: &[&str] = &["usize", "u8", "u16", "u32", "u64"];
    matches!(ty, Type::Path(p) if p.qself.is_none() && p.path.get_ident().is_some_and(|i| INTS.contains(&i.to_string().as_str())))
}

/// Whether a type is `BatchPlan` (any path ending in it).
pub fn is_batch_plan(ty: &Type) -> bool {
    matches!(ty, Type::Path(p) if p.path.segments.last().is_some_and(|s| s.ident == "BatchPlan"))
}

/// Whether the return type mentions `impl Trait` (then it cannot be written on a closure).
pub fn returns_impl_trait(f: &ItemFn) -> bool {
    match &f.sig.output {
        ReturnType::Type(_, ty) => quote::quote!(#ty).to_string().contains("impl "),
        ReturnType::Default => false,
    }
}
