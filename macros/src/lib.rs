//! Attribute macros of oomguard: `#[oom_retry]`, `#[memory_budget]`, `#[leak_check]` and
//! `#[no_grad]`. Use them through the `oomguard` facade, which re-exports them; the generated code
//! calls the runtime through the facade's hidden `__private` module.
//!
//! Each macro parses its arguments (`args.rs`, `options.rs`), checks the function (`check.rs`)
//! and generates code (`expand.rs`). Every problem is a compile error at its token; on error the
//! original function is still emitted so that the rest of the crate type-checks. No macro panics.
//!
//! See the `oomguard` crate for documentation and examples.

mod args;
mod check;
mod expand;
mod options;

use proc_macro::TokenStream;
use quote::ToTokens;

use args::Errors;

fn run(name: &str, args: TokenStream, item: TokenStream) -> TokenStream {
    let item2: proc_macro2::TokenStream = item.clone().into();
    let f: syn::ItemFn = match syn::parse2(item2.clone()) {
        Ok(f) => f,
        Err(_) => {
            let err = syn::Error::new(
                proc_macro2::Span::call_site(),
                format!("#[{name}] applies to functions (free functions and methods) only"),
            );
            let mut out = err.to_compile_error();
            out.extend(item2);
            return out.into();
        }
    };
    let original = f.to_token_stream();
    let mut errors = Errors::default();
    let out = match name {
        "oom_retry" => expand::oom_retry(args.into(), f, &mut errors),
        _ => expand::guard_attribute(name, args.into(), f, &mut errors),
    };
    match errors.finish() {
        // On error, emit the original function unchanged, with the errors.
        Some(e) => {
            let mut ts = e.to_compile_error();
            ts.extend(original);
            ts.into()
        }
        None => out.into(),
    }
}

/// An attribute macro of oomguard: use it through the `oomguard` crate, which documents it.
#[proc_macro_attribute]
pub fn oom_retry(args: TokenStream, item: TokenStream) -> TokenStream {
    run("oom_retry", args, item)
}

/// An attribute macro of oomguard: use it through the `oomguard` crate, which documents it.
#[proc_macro_attribute]
pub fn memory_budget(args: TokenStream, item: TokenStream) -> TokenStream {
    run("memory_budget", args, item)
}

/// An attribute macro of oomguard: use it through the `oomguard` crate, which documents it.
#[proc_macro_attribute]
pub fn leak_check(args: TokenStream, item: TokenStream) -> TokenStream {
    run("leak_check", args, item)
}

/// An attribute macro of oomguard: use it through the `oomguard` crate, which documents it.
#[proc_macro_attribute]
pub fn no_grad(args: TokenStream, item: TokenStream) -> TokenStream {
    run("no_grad", args, item)
}
