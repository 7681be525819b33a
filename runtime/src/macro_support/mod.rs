//! What the attribute macros' generated code calls, through the facade's hidden `__private`
//! module (a list of re-exports of this one). Not public API: hidden, and free to change in
//! any release (the macros, the facade and the runtime are released together). It lives here,
//! above the retry engine and the guards it drives, so that it is tested with them.

mod const_key;
mod engines;
mod guards;
mod retry;

pub use const_key::{
    ConstBool, ConstChar, ConstI128, ConstI16, ConstI32, ConstI64, ConstI8, ConstIsize, ConstU128,
    ConstU16, ConstU32, ConstU64, ConstU8, ConstUsize,
};
pub use engines::{forget, remembered};
pub use guards::{
    budget, budget_bytes, guarded, leak_check, leak_result, leak_result_of, leak_result_of_retried,
    leak_result_retried, no_grad, BudgetBytes, BudgetLimit, GuardSpec,
};
pub use retry::{
    boxed_policy, clone_for_retry, BatchInt, FnResult, Retry, RetryConfig, RetryKind, Site,
    SiteCache,
};
