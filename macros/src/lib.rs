//! Attribute macros of oomguard. The attributes themselves land with the macros issue; this crate
//! is re-exported by the `oomguard` facade.
