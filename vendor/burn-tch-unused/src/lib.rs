//! Stands in for burn 0.21's `burn-tch` in oomguard's workspace lockfile: never built.
//!
//! Cargo locks every optional dependency of the workspace's dependencies, and one lockfile may
//! hold only one package that links `tch`. burn 0.21's optional `burn-tch` (burn's `tch`
//! feature, which oomguard never turns on) pins torch-sys 0.22 (libtorch 2.9); oomguard's `tch`
//! feature needs torch-sys 0.24 (libtorch 2.11). The root `Cargo.toml` patches `burn-tch` with
//! this empty crate so that the lockfile holds torch-sys 0.24 only.
compile_error!(
    "burn's `tch` backend is patched out of oomguard's workspace (vendor/burn-tch-unused): \
     oomguard links tch 0.24 (libtorch 2.11), burn-tch 0.21 needs tch 0.22 (libtorch 2.9)"
);
