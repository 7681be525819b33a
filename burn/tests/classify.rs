//! Out-of-memory classification against the exact error values cubecl 0.10 builds: each value
//! is made with cubecl-runtime's own types, formatted the way burn-cubecl 0.21 flattens it into
//! `ExecutionError::WithContext` (`format!("{err}")` for reads and `sync`, `format!("{err:?}")`
//! for transactions), and classified. A cubecl or burn version that changes these texts fails
//! here. Unrelated errors, including ones whose text quotes an out-of-memory, are not OOM.
// `Err(..).unwrap()` on purpose: the panic message of `unwrap` is what cubecl raises.
#![allow(clippy::unnecessary_literal_unwrap)]

use burn::tensor::backend::ExecutionError;
use cubecl_common::backtrace::BackTrace;
use cubecl_runtime::server::{IoError, LaunchError, ProfileError, ServerError};
use oomguard::IsOom;
use oomguard_burn::compat::{INTO_DATA_EXPECT, UNWRAP};
use oomguard_burn::{panic_message_is_oom, Error};

fn too_big() -> IoError {
    // cubecl-cuda's storage on CUDA_ERROR_OUT_OF_MEMORY, and cubecl's pools past their size.
    IoError::BufferTooBig {
        size: 68_719_476_736,
        backtrace: BackTrace::capture(),
    }
}

/// Both ways burn-cubecl turns a `ServerError` into an `ExecutionError`.
fn as_burn(e: &ServerError) -> [ExecutionError; 2] {
    [
        ExecutionError::WithContext {
            reason: format!("{e}"),
        },
        ExecutionError::WithContext {
            reason: format!("{e:?}"),
        },
    ]
}

fn all_oom(e: ServerError) {
    for b in as_burn(&e) {
        assert!(b.is_oom(), "not recognised: {b}");
        assert!(Error::from(b).is_oom());
    }
}

fn none_oom(e: ServerError) {
    for b in as_burn(&e) {
        assert!(!b.is_oom(), "taken for an OOM: {b}");
    }
}

#[test]
fn cubecl_out_of_memory_values_are_oom() {
    all_oom(ServerError::Io(too_big()));
    all_oom(ServerError::Launch(LaunchError::OutOfMemory {
        reason: "cuMemAlloc failed".into(),
        backtrace: BackTrace::capture(),
    }));
    all_oom(ServerError::Launch(LaunchError::IoError(too_big())));
    all_oom(ServerError::Io(IoError::Execution(Box::new(
        ServerError::Io(too_big()),
    ))));
    all_oom(ServerError::Profile(ProfileError::Server(Box::new(
        ServerError::Io(too_big()),
    ))));
    // The stream's errors, flushed at the next read or sync: the first one is the cause.
    all_oom(ServerError::ServerUnhealthy {
        errors: vec![
            ServerError::Io(too_big()),
            ServerError::Io(IoError::NotFound {
                backtrace: BackTrace::capture(),
                reason: "Memory page 0 doesn't exist".to_string().into(),
            }),
        ],
        backtrace: BackTrace::capture(),
    });
}

#[test]
fn other_cubecl_errors_are_not_oom() {
    // A driver allocation failure other than CUDA_ERROR_OUT_OF_MEMORY.
    none_oom(ServerError::Io(IoError::Unknown {
        description: "CUDA allocation error: CUDA_ERROR_INVALID_VALUE".into(),
        backtrace: BackTrace::capture(),
    }));
    // Generic errors whose reason quotes an out-of-memory text.
    none_oom(ServerError::Generic {
        reason: format!("{}", too_big()),
        backtrace: BackTrace::capture(),
    });
    none_oom(ServerError::Profile(ProfileError::Unknown {
        reason: format!("{:?}", vec![ServerError::Io(too_big())]),
        backtrace: BackTrace::capture(),
    }));
    none_oom(ServerError::Launch(LaunchError::Unknown {
        reason: "out of memory".into(),
        backtrace: BackTrace::capture(),
    }));
    none_oom(ServerError::Io(IoError::NotFound {
        backtrace: BackTrace::capture(),
        reason: "Memory page 0 doesn't exist".to_string().into(),
    }));
    // An unhealthy server whose first error is not an out-of-memory.
    none_oom(ServerError::ServerUnhealthy {
        errors: vec![
            ServerError::Generic {
                reason: "kernel failed".into(),
                backtrace: BackTrace::capture(),
            },
            ServerError::Io(too_big()),
        ],
        backtrace: BackTrace::capture(),
    });
    // burn's own errors never come from cubecl.
    assert!(!ExecutionError::Generic {
        reason: format!("{}", too_big()),
        backtrace: Default::default(),
    }
    .is_oom());
    assert!(!Error::Rows("x".into()).is_oom());
}

/// The panic messages of the forms that reach a user: `unwrap` of cubecl's error (the device
/// thread's `initialize_memory`, `ComputeClient::create`) and `into_data`'s `expect`.
fn panic_text(f: impl FnOnce() + std::panic::UnwindSafe) -> String {
    let payload = std::panic::catch_unwind(f).unwrap_err();
    payload
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap()
}

#[test]
fn panic_messages_are_classified_by_shape() {
    let prev = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {})); // quiet: these panics are expected
    let unwrap = panic_text(|| Err::<(), _>(too_big()).unwrap());
    assert!(unwrap.starts_with(UNWRAP), "{unwrap}");
    assert!(panic_message_is_oom(&unwrap), "{unwrap}");
    let unhealthy = ServerError::ServerUnhealthy {
        errors: vec![ServerError::Io(too_big())],
        backtrace: BackTrace::capture(),
    };
    for reason in [format!("{unhealthy}"), format!("{unhealthy:?}")] {
        let into_data = panic_text(move || {
            Err::<(), _>(ExecutionError::WithContext { reason }).expect(INTO_DATA_EXPECT)
        });
        assert!(panic_message_is_oom(&into_data), "{into_data}");
    }
    let other = panic_text(|| {
        Err::<(), _>(ExecutionError::WithContext {
            reason: "An error happened during execution\nCaused by:\n  boom".into(),
        })
        .expect(INTO_DATA_EXPECT)
    });
    assert!(!panic_message_is_oom(&other), "{other}");
    let io_unknown = panic_text(|| {
        Err::<(), _>(IoError::Unknown {
            description: "x".into(),
            backtrace: BackTrace::capture(),
        })
        .unwrap()
    });
    assert!(!panic_message_is_oom(&io_unknown));
    assert!(!panic_message_is_oom(
        "index out of bounds: can't allocate buffer of size: 4"
    ));
    std::panic::set_hook(prev);
}
