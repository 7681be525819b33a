//! Code generation. Every expansion calls the runtime through the facade's hidden `__private`
//! module (`::oomguard::__private` unless `crate = "path"` says otherwise).

use proc_macro2::TokenStream;
use quote::{format_ident, quote, quote_spanned, ToTokens};
use syn::spanned::Spanned;
use syn::{Attribute, ItemFn, Pat, ReturnType};

use crate::args::{self, Errors};
use crate::check::{self, Passing};
use crate::options::{self, BudgetLimit, BudgetOptions, LeakAction, LeakOptions, RetryOptions};

/// The scoped guards wrapped around a body (one attempt of a retried function, or the whole
/// body of a function without `#[oom_retry]`).
#[derive(Default)]
pub struct Guards {
    /// The function's name, for leak reports.
    pub function: String,
    pub no_grad: bool,
    pub budget: Option<BudgetLimit>,
    pub leak: Option<LeakOptions>,
    /// The guards of an `#[oom_retry]` attempt: a leak also wins over the attempt's
    /// out-of-memory error (a retry would lose it).
    pub in_retry: bool,
}

/// Names of the guard attributes, which move inside `#[oom_retry]` so that they apply to each
/// attempt.
pub const GUARD_ATTRS: &[&str] = &["memory_budget", "leak_check", "no_grad"];

fn attr_name(a: &Attribute) -> Option<String> {
    a.path().segments.last().map(|s| s.ident.to_string())
}

/// An identifier of the generated code, hygienic (`Span::mixed_site`): a parameter or local of
/// the user's named like it cannot clash with it.
fn generated(name: &str) -> proc_macro2::Ident {
    proc_macro2::Ident::new(name, proc_macro2::Span::mixed_site())
}

pub fn default_crate() -> syn::Path {
    syn::parse_quote!(::oomguard)
}

/// `#[no_grad]`, `#[memory_budget]`, `#[leak_check]` on their own: the guards wrap the body.
/// When `#[oom_retry]` is also on the function, the attribute moves below it instead, so that
/// `#[oom_retry]` applies it to each attempt whatever the order they were written in.
pub fn guard_attribute(
    name: &str,
    args: TokenStream,
    f: ItemFn,
    errors: &mut Errors,
) -> TokenStream {
    let list = match args::parse_args(args.clone()) {
        Ok(l) => l,
        Err(e) => {
            errors.push(e);
            return f.into_token_stream();
        }
    };
    let mut guards = Guards {
        function: f.sig.ident.to_string(),
        ..Guards::default()
    };
    let krate = parse_guard(
        name,
        list,
        &mut guards,
        proc_macro2::Span::call_site(),
        errors,
    );
    check::not_const(&f, name, errors);
    check::not_impl_future(&f, name, errors);
    check_leak_error(&f, &guards, errors);
    if let Some(retry) = f
        .attrs
        .iter()
        .find(|a| attr_name(a).as_deref() == Some("oom_retry"))
    {
        // Moved below `#[oom_retry]`, which absorbs it: under the crate path `#[oom_retry]`
        // names (its `crate = ...`, or the path it is written with), unless this one has its own.
        let krate = krate
            .or_else(|| retry_crate(retry))
            .unwrap_or_else(default_crate);
        let mut f = f;
        let ident = format_ident!("{}", name);
        f.attrs.push(syn::parse_quote!(#[#krate::#ident(#args)]));
        return f.into_token_stream();
    }
    wrap_function(f, &guards, &krate.unwrap_or_else(default_crate))
}

/// The facade's path as an `#[oom_retry]` attribute names it: its `crate = "..."` option, or the
/// prefix of its path (`#[og::oom_retry]`).
fn retry_crate(a: &Attribute) -> Option<syn::Path> {
    if let syn::Meta::List(l) = &a.meta {
        if let Ok(list) = args::parse_args(l.tokens.clone()) {
            for arg in list {
                if let args::Arg::KeyValue { key, value } = arg {
                    if key == "crate" {
                        return args::crate_path(&value, &mut Errors::default());
                    }
                }
            }
        }
    }
    let segs = &a.path().segments;
    (segs.len() > 1).then(|| {
        let mut p = a.path().clone();
        p.segments.pop();
        // drop the trailing `::` left by the popped segment
        let last = p.segments.pop().map(|s| s.into_value());
        p.segments.extend(last);
        p
    })
}

/// `#[leak_check(action = error)]` turns a leak into the function's `Err`: it needs a `Result`.
fn check_leak_error(f: &ItemFn, guards: &Guards, errors: &mut Errors) {
    if guards
        .leak
        .as_ref()
        .is_some_and(|l| l.action == LeakAction::Error)
    {
        check::require_result(
            f,
            "leak_check",
            "with `action = error` a leak becomes the function's `Err`",
            errors,
        );
    }
}

/// Parses one guard attribute's options into `guards`; returns its `crate` path, if given.
fn parse_guard(
    name: &str,
    list: Vec<args::Arg>,
    guards: &mut Guards,
    span: proc_macro2::Span,
    errors: &mut Errors,
) -> Option<syn::Path> {
    match name {
        "no_grad" => {
            guards.no_grad = true;
            options::no_grad_options(list, errors)
        }
        "memory_budget" => {
            let o = BudgetOptions::from_args(list, span, errors);
            guards.budget = o.limit;
            o.krate
        }
        "leak_check" => {
            let o = LeakOptions::from_args(list, errors);
            let k = o.krate.clone();
            guards.leak = Some(o);
            k
        }
        _ => None,
    }
}

/// The function with its body wrapped in `guards`.
fn wrap_function(f: ItemFn, guards: &Guards, krate: &syn::Path) -> TokenStream {
    let body = &f.block;
    let ret = return_type(&f);
    let new_body = if f.sig.asyncness.is_some() {
        let fut = quote!(async move #body);
        let guarded = guarded_future(fut, guards, krate, &ret);
        quote!({ #guarded })
    } else {
        guarded_block(quote!(#body), guards, krate, &ret)
    };
    let mut f = f;
    if guards
        .leak
        .as_ref()
        .is_some_and(|l| l.action != LeakAction::Error)
    {
        // The body's value is read after its block (see `guarded_block`): a body that ends by
        // diverging (`panic!`) would make that read "unreachable code".
        f.attrs.push(syn::parse_quote!(#[allow(unreachable_code)]));
    }
    set_block(f, new_body)
}

/// Replaces the body; a block that does not parse (a bug here) becomes a compile error, never a
/// panic.
fn set_block(mut f: ItemFn, block: TokenStream) -> TokenStream {
    match syn::parse2(block) {
        Ok(b) => {
            f.block = b;
            f.into_token_stream()
        }
        Err(e) => {
            let mut out = e.to_compile_error();
            out.extend(f.into_token_stream());
            out
        }
    }
}

/// The return type written on a closure, when it can be (not with `impl Trait`).
fn return_type(f: &ItemFn) -> Option<TokenStream> {
    if check::returns_impl_trait(f) {
        return None;
    }
    Some(match &f.sig.output {
        ReturnType::Type(_, ty) => quote!(#ty),
        ReturnType::Default => quote!(()),
    })
}

/// A synchronous body run inside the guards; `body` is a block expression.
fn guarded_block(
    body: TokenStream,
    g: &Guards,
    krate: &syn::Path,
    ret: &Option<TokenStream>,
) -> TokenStream {
    let __oomguard_budget = generated("__oomguard_budget");
    let __oomguard_grad = generated("__oomguard_grad");
    let __oomguard_leak = generated("__oomguard_leak");
    let __oomguard_out = generated("__oomguard_out");
    let p = quote!(#krate::__private);
    let leak_result = if g.in_retry {
        quote!(leak_result_retried)
    } else {
        quote!(leak_result)
    };
    let function = &g.function;
    let grad = g
        .no_grad
        .then(|| quote!(let #__oomguard_grad = #p::no_grad();));
    let limit = g.budget.as_ref().map(|b| budget_limit(b, &p));
    // With a leak check, the budget is the leak check's scope too (one scope, not two).
    let leak_budget = match (&g.leak, &limit) {
        (Some(_), Some(l)) => quote!(::core::option::Option::Some(#l)),
        _ => quote!(::core::option::Option::None),
    };
    let budget = limit
        .filter(|_| g.leak.is_none())
        .map(|l| quote!(let #__oomguard_budget = #p::budget(#l);));
    match &g.leak {
        Some(l) if l.action == LeakAction::Error => {
            let allow = l.allow;
            let arrow = ret.as_ref().map(|r| quote!(-> #r));
            quote!({
                let #__oomguard_leak = #p::leak_check(#p::LeakAction::Report, #allow, #function, #leak_budget);
                #[allow(clippy::redundant_closure_call)]
                let #__oomguard_out = {
                    #budget
                    #grad
                    (|| #arrow #body)()
                };
                #p::#leak_result(#__oomguard_leak, #__oomguard_out)
            })
        }
        Some(l) => {
            let (allow, action) = (l.allow, leak_action(l.action, &p));
            let stmts = statements(body);
            // The body's value is taken before the check ends: the temporaries of its last
            // expression (`Ok(dev.alloc(..)?.len())`) are dropped at the end of this `let`, not
            // after the check, which reported them as leaked.
            quote!({
                let #__oomguard_leak = #p::leak_check(#action, #allow, #function, #leak_budget);
                #budget
                #grad
                #[allow(unused_braces, clippy::let_and_return, clippy::let_unit_value)]
                let #__oomguard_out = { #stmts };
                #__oomguard_out
            })
        }
        None => {
            let stmts = statements(body);
            quote!({
                #budget
                #grad
                #stmts
            })
        }
    }
}

/// The statements of a block, to splice after the guards (a nested block around an expression
/// body would draw an `unused_braces` warning with a wrong fix).
fn statements(block: TokenStream) -> TokenStream {
    match syn::parse2::<syn::Block>(block.clone()) {
        Ok(b) => {
            let st = &b.stmts;
            quote!(#(#st)*)
        }
        Err(_) => block,
    }
}

/// An `async` body (`fut`, a future expression) run inside the guards, entered on each poll so
/// that the guard state never leaks to other tasks across an `.await`.
fn guarded_future(
    fut: TokenStream,
    g: &Guards,
    krate: &syn::Path,
    ret: &Option<TokenStream>,
) -> TokenStream {
    let __oomguard_leak = generated("__oomguard_leak");
    let __oomguard_out = generated("__oomguard_out");
    let p = quote!(#krate::__private);
    let leak_result_of = if g.in_retry {
        quote!(leak_result_of_retried)
    } else {
        quote!(leak_result_of)
    };
    let budget = match &g.budget {
        Some(b) => {
            let l = budget_limit(b, &p);
            quote!(::core::option::Option::Some(#l))
        }
        None => quote!(::core::option::Option::None),
    };
    let no_grad = g.no_grad;
    let (leak, is_error) = match &g.leak {
        Some(l) => {
            let (allow, action) = (l.allow, leak_action(l.action, &p));
            let action = if l.action == LeakAction::Error {
                quote!(#p::LeakAction::Report)
            } else {
                action
            };
            (
                quote!(::core::option::Option::Some((#action, #allow))),
                l.action == LeakAction::Error,
            )
        }
        None => (quote!(::core::option::Option::None), false),
    };
    let out_ty = ret.as_ref().map_or(quote!(_), |r| r.clone());
    let function = &g.function;
    let call = quote!(#p::guarded::<#out_ty, _>(#p::GuardSpec { no_grad: #no_grad, budget: #budget, leak: #leak, function: #function }, #fut));
    if is_error {
        quote!({
            let (#__oomguard_leak, #__oomguard_out) = #call.await;
            #p::#leak_result_of(#__oomguard_leak, #__oomguard_out)
        })
    } else {
        quote!(#call.await.1)
    }
}

fn budget_limit(b: &BudgetLimit, p: &TokenStream) -> TokenStream {
    match b {
        BudgetLimit::Bytes(n) => quote!(#p::BudgetLimit::Bytes(#n)),
        // Integer literals without a type fall back to `i32` through a generic function: `4 <<
        // 30` became 0 bytes. Arithmetic of untyped literals is read as u64 bytes.
        BudgetLimit::Expr(e) if untyped_integers(e) => {
            let bytes = generated("__oomguard_bytes");
            quote_spanned!(e.span()=> #p::BudgetLimit::Bytes({ let #bytes: u64 = #e; #bytes }))
        }
        BudgetLimit::Expr(e) => {
            quote_spanned!(e.span()=> #p::BudgetLimit::Bytes(#p::budget_bytes(#e)))
        }
        BudgetLimit::Fraction(f) => quote!(#p::BudgetLimit::Fraction(#f)),
    }
}

/// The `__private` type that names a const generic's value in a type (`ConstU8<N>`).
fn const_key(ty: &syn::Type) -> Option<proc_macro2::Ident> {
    let syn::Type::Path(p) = ty else { return None };
    let name = p.path.get_ident()?.to_string();
    let holder = match name.as_str() {
        "u8" | "u16" | "u32" | "u64" | "u128" | "usize" | "i8" | "i16" | "i32" | "i64" | "i128"
        | "isize" | "bool" | "char" => format!("Const{}", capitalize(&name)),
        _ => return None,
    };
    Some(format_ident!("{holder}"))
}

fn capitalize(s: &str) -> String {
    let mut c = s.chars();
    c.next()
        .map(|f| f.to_ascii_uppercase().to_string() + c.as_str())
        .unwrap_or_default()
}

/// Whether `e` is arithmetic of integer literals without a type suffix (`4 << 30`, `(1 + 2) *
/// 1024`): its type comes from where it is used.
fn untyped_integers(e: &syn::Expr) -> bool {
    match e {
        syn::Expr::Lit(syn::ExprLit {
            lit: syn::Lit::Int(i),
            ..
        }) => i.suffix().is_empty(),
        syn::Expr::Binary(b) => untyped_integers(&b.left) && untyped_integers(&b.right),
        syn::Expr::Paren(p) => untyped_integers(&p.expr),
        syn::Expr::Group(g) => untyped_integers(&g.expr),
        syn::Expr::Unary(u) => untyped_integers(&u.expr),
        _ => false,
    }
}

fn leak_action(a: LeakAction, p: &TokenStream) -> TokenStream {
    match a {
        LeakAction::Panic => quote!(#p::LeakAction::Panic),
        LeakAction::Warn => quote!(#p::LeakAction::Warn),
        LeakAction::Error => quote!(#p::LeakAction::Report),
    }
}

/// `#[oom_retry]`: the body becomes one attempt, run again with a smaller plan after an
/// out-of-memory. Guard attributes on the same function apply to each attempt.
pub fn oom_retry(args: TokenStream, mut f: ItemFn, errors: &mut Errors) -> TokenStream {
    let __oomguard_attempt = generated("__oomguard_attempt");
    let __oomguard_committed = generated("__oomguard_committed");
    let __oomguard_done = generated("__oomguard_done");
    let __oomguard_e = generated("__oomguard_e");
    let __oomguard_out = generated("__oomguard_out");
    let __oomguard_retry = generated("__oomguard_retry");
    let __oomguard_v = generated("__oomguard_v");
    let __oomguard_value = generated("__oomguard_value");
    let list = match args::parse_args(args) {
        Ok(l) => l,
        Err(e) => {
            errors.push(e);
            return f.into_token_stream();
        }
    };
    let opts = RetryOptions::from_args(list, errors);
    check::not_const(&f, "oom_retry", errors);
    check::require_result(&f, "oom_retry", "retries on an out-of-memory error", errors);
    check::no_value_self(&f, errors);

    // Guard attributes move inside: they apply to each attempt.
    let mut guards = Guards {
        function: f.sig.ident.to_string(),
        in_retry: true,
        ..Guards::default()
    };
    let mut kept = Vec::new();
    let mut absorbed = Vec::new();
    let mut seen_guards: Vec<String> = Vec::new();
    let mut guard_crate = None;
    for a in std::mem::take(&mut f.attrs) {
        match attr_name(&a) {
            Some(n) if n == "oom_retry" => {
                errors.at(
                    &a,
                    "#[oom_retry] is given twice: one retry loop per function (nested loops would multiply the attempts)",
                );
            }
            Some(n) if GUARD_ATTRS.contains(&n.as_str()) && seen_guards.contains(&n) => {
                errors.at(
                    &a,
                    format!("#[{n}] is given twice: give it once (each attempt runs under one)"),
                );
            }
            Some(n) if GUARD_ATTRS.contains(&n.as_str()) => {
                seen_guards.push(n.clone());
                // Keep the user's import of the attribute used, though it expands no more.
                let path = a.path().clone();
                absorbed.push(quote!(#[allow(unused_imports)] use #path as _;));
                let tokens = match &a.meta {
                    syn::Meta::List(l) => l.tokens.clone(),
                    syn::Meta::Path(_) => TokenStream::new(),
                    syn::Meta::NameValue(_) => {
                        errors.at(
                            &a,
                            format!("#[{n} = ...] takes no value: write #[{n}] or #[{n}(options)]"),
                        );
                        continue;
                    }
                };
                match args::parse_args(tokens) {
                    Ok(list) => {
                        let k = parse_guard(&n, list, &mut guards, a.span(), errors);
                        guard_crate = guard_crate.or(k);
                    }
                    Err(e) => errors.push(e),
                }
            }
            _ => kept.push(a),
        }
    }
    f.attrs = kept;
    check_leak_error(&f, &guards, errors);
    // The facade's path: this attribute's `crate`, else one given on a guard attribute.
    let krate = opts
        .krate
        .clone()
        .or(guard_crate)
        .unwrap_or_else(default_crate);

    let params = check::params(&f);
    let p = quote!(#krate::__private);
    // What the retry controls: a batch size, a batch plan, or nothing (empty-cache retries only).
    let mut kind = quote!(#p::RetryKind::Plain);
    let mut rebind = Vec::new();
    // The commit sees the `batch`/`plan` of the attempt that succeeded, not the caller's: with
    // a shrunk batch it must not advance past rows that were never processed.
    let mut commit_rebind = Vec::new();
    let allow_unused = opts
        .commit
        .as_ref()
        .map(|_| quote!(#[allow(unused_variables)]));
    // The commit may leave the rebound `batch`/`plan` unused.
    let allow_in_commit = Some(quote!(#[allow(unused_variables)]));
    for (i, prm) in params.iter().enumerate() {
        if matches!(&*prm.pat, Pat::Wild(_)) {
            // `_`: never used, nothing to pass again
            continue;
        }
        let Some(ident) = &prm.ident else {
            errors.at(&prm.pat, "#[oom_retry] needs plain names for parameters (no patterns), so each attempt can pass them again");
            continue;
        };
        let pat = &prm.pat;
        let ty = &prm.ty;
        if opts.batch.as_ref() == Some(ident) {
            if !check::is_batch_integer(ty) {
                errors.at(ty, format!("`batch = {ident}` needs an unsigned integer parameter (usize, u64, u32, u16 or u8), not this type"));
            }
            kind = quote!(#p::RetryKind::Batch(#p::BatchInt::to_u64(#ident)));
            let bind = |allow: &Option<TokenStream>| quote!(#allow let #pat: #ty = #p::BatchInt::from_u64(#__oomguard_retry.batch()););
            rebind.push(bind(&allow_unused));
            commit_rebind.push(bind(&allow_in_commit));
            continue;
        }
        if opts.plan.as_ref() == Some(ident) {
            let by_ref = matches!(prm.passing, Passing::SharedRef);
            let inner: &syn::Type = match &**ty {
                syn::Type::Reference(r) => &r.elem,
                t => t,
            };
            if !check::is_batch_plan(inner) || matches!(prm.passing, Passing::MutRef) {
                errors.at(
                    ty,
                    format!(
                        "`plan = {ident}` needs a parameter of type `BatchPlan` or `&BatchPlan`"
                    ),
                );
            }
            let init = if by_ref {
                quote!(::core::clone::Clone::clone(#ident))
            } else {
                quote!(#ident)
            };
            kind = quote!(#p::RetryKind::Plan(#init));
            let tmp = proc_macro2::Ident::new(
                &format!("__oomguard_plan{i}"),
                proc_macro2::Span::mixed_site(),
            );
            for (list, allow) in [
                (&mut rebind, &allow_unused),
                (&mut commit_rebind, &allow_in_commit),
            ] {
                list.push(if by_ref {
                    quote!(let #tmp = #__oomguard_retry.plan(); #allow let #pat = &#tmp;)
                } else {
                    quote!(#allow let #pat = #__oomguard_retry.plan();)
                });
            }
            continue;
        }
        match prm.passing {
            Passing::SharedRef => {}
            // With a commit phase a parameter may be used by the commit only: its rebinding in
            // the attempt is then unused, and the warning would be wrong.
            Passing::MutRef => rebind.push(quote!(#allow_unused let #pat = &mut *#ident;)),
            Passing::Value => rebind.push(
                quote_spanned!(pat.span()=> #allow_unused #[allow(unused_mut)] let #pat = #p::clone_for_retry(&#ident);),
            ),
        }
    }
    for (opt, what) in [(&opts.batch, "batch"), (&opts.plan, "plan")] {
        if let Some(id) = opt {
            if !params.iter().any(|p| p.ident.as_ref() == Some(id)) {
                errors.at(
                    id,
                    format!("`{what} = {id}`: the function has no parameter named `{id}`"),
                );
            }
        }
    }
    // Outer `mut` on cloned parameters is unused when only the attempts (which rebind them)
    // touch them, and used by a commit that mutates one: kept, its warning allowed.
    for a in f.sig.inputs.iter_mut() {
        if let syn::FnArg::Typed(t) = a {
            if let Pat::Ident(pi) = &*t.pat {
                if pi.mutability.is_some() && !matches!(&*t.ty, syn::Type::Reference(_)) {
                    t.attrs.push(syn::parse_quote!(#[allow(unused_mut)]));
                }
            }
        }
    }

    let opt = |o: Option<TokenStream>| {
        o.map_or(
            quote!(::core::option::Option::None),
            |t| quote!(::core::option::Option::Some(#t)),
        )
    };
    let min = opt(opts.min.map(|m| quote!(#m)));
    let max_retries = opt(opts.max_retries.map(|m| quote!(#m)));
    let remember = opt(opts.remember.map(|m| quote!(#m)));
    let persist = opt(opts.persist.as_ref().map(|s| quote!(#s)));
    let policy = opt(opts
        .policy
        .as_ref()
        .map(|e| quote_spanned!(e.span()=> #p::boxed_policy(#e))));
    let name = f.sig.ident.to_string();
    let line = quote_spanned!(f.sig.ident.span()=> ::core::line!());
    let ret = return_type(&f);
    // With a commit phase the body is the attempt: it returns the value handed to the commit
    // (any type), with the function's error type.
    let attempt_ret = match (&opts.commit, &ret) {
        (Some(_), Some(r)) => Some(quote!(::core::result::Result<_, <#r as #p::FnResult>::Err>)),
        (Some(_), None) => None,
        (None, r) => r.clone(),
    };
    let body = &f.block;
    let attempt = if f.sig.asyncness.is_some() {
        let fut = quote!(async #body);
        guarded_future(fut, &guards, &krate, &attempt_ret)
    } else {
        let arrow = attempt_ret.as_ref().map(|r| quote!(-> #r));
        let inner = quote!({
            #[allow(clippy::redundant_closure_call)]
            let #__oomguard_attempt = (|| #arrow #body)();
            #__oomguard_attempt
        });
        guarded_block(inner, &guards, &krate, &attempt_ret)
    };
    let no_grad = guards.no_grad;
    // Plans are remembered per generic instance: the memory of `step::<f32>` is not
    // `step::<f64>`'s, nor `Big::eval`'s that of `Small::eval` (a method's `Self`, which holds
    // its impl's generics), nor `f::<4>`'s that of `f::<8>` (const generics).
    let mut key_types: Vec<TokenStream> = f
        .sig
        .generics
        .type_params()
        .map(|t| t.ident.to_token_stream())
        .collect();
    if f.sig.receiver().is_some() {
        // (in a tuple: `Self` of a trait's default method need not be sized)
        key_types.push(quote!(::core::marker::PhantomData<Self>));
    }
    for c in f.sig.generics.const_params() {
        let id = &c.ident;
        match const_key(&c.ty) {
            Some(holder) => key_types.push(quote!(#p::#holder<#id>)),
            None => errors.at(
                &c.ty,
                "#[oom_retry] remembers plans per generic instance; a const parameter of this \
                 type cannot name one (use an integer, bool or char)",
            ),
        }
    }
    let instance = if key_types.is_empty() {
        quote!("")
    } else {
        quote!(::core::any::type_name::<(#(#key_types,)*)>())
    };
    // `Retry::<E>`, E from the return type (through `FnResult`, so that aliases work and a
    // return type that is not a `Result` gets a clear error).
    let err_turbofish = ret
        .as_ref()
        .map(|r| quote_spanned!(r.span()=> <<#r as #p::FnResult>::Err>::));
    let config = quote!(#p::RetryConfig {
        site: #p::Site {
            file: ::core::file!(),
            line: #line,
            function: #name,
            key: ::core::concat!(::core::file!(), ":", #line, " ", #name),
            instance: #instance,
        },
        kind: #kind,
        min: #min,
        max_retries: #max_retries,
        remember: #remember,
        persist: #persist,
        policy: #policy,
        no_grad: #no_grad,
    });
    let new_body = match &opts.commit {
        None => quote!({
            #(#absorbed)*
            static __OOMGUARD_SITE: #p::SiteCache = #p::SiteCache::new();
            let mut #__oomguard_retry = #p::Retry::#err_turbofish new(#config, &__OOMGUARD_SITE);
            loop {
                #(#rebind)*
                let #__oomguard_out = #attempt;
                match #__oomguard_retry.next(#__oomguard_out) {
                    ::core::ops::ControlFlow::Break(#__oomguard_done) => return #__oomguard_done,
                    ::core::ops::ControlFlow::Continue(()) => {}
                }
            }
        }),
        Some(commit) => {
            let ret_ty = ret.clone().unwrap_or_else(|| quote!(_));
            // The closure gets the function's return type, so that a mismatch is reported in
            // its body.
            let mut commit = commit.clone();
            if let (syn::Expr::Closure(c), Some(r)) = (&mut commit, &ret) {
                if matches!(c.output, ReturnType::Default) {
                    let b = &c.body;
                    let block = quote_spanned!(b.span()=> { #b });
                    if let (Ok(ty), Ok(body)) = (syn::parse2(r.clone()), syn::parse2(block)) {
                        c.output = ReturnType::Type(Default::default(), Box::new(ty));
                        *c.body = body;
                    }
                }
            }
            // The commit runs once, outside the retry loop and outside the attempt's guards
            // (a `#[leak_check(action = error)]` of the attempt has already passed).
            let call = quote_spanned!(commit.span()=>
                #[allow(clippy::redundant_closure_call)]
                let #__oomguard_committed: #ret_ty = (#commit)(#__oomguard_value);
            );
            quote!({
                #(#absorbed)*
                static __OOMGUARD_SITE: #p::SiteCache = #p::SiteCache::new();
            let mut #__oomguard_retry = #p::Retry::#err_turbofish new(#config, &__OOMGUARD_SITE);
                let #__oomguard_value = loop {
                    #(#rebind)*
                    let #__oomguard_out = #attempt;
                    match #__oomguard_retry.next(#__oomguard_out) {
                        ::core::ops::ControlFlow::Break(::core::result::Result::Ok(#__oomguard_v)) => {
                            break #__oomguard_v
                        }
                        ::core::ops::ControlFlow::Break(::core::result::Result::Err(#__oomguard_e)) => {
                            return ::core::result::Result::Err(#__oomguard_e)
                        }
                        ::core::ops::ControlFlow::Continue(()) => {}
                    }
                };
                #(#commit_rebind)*
                #__oomguard_retry.commit_starting();
                #call
                #__oomguard_retry.committed(#__oomguard_committed)
            })
        }
    };
    set_block(f, new_body)
}
