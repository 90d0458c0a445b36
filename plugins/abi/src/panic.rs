//! The one place where plugin code meets `catch_unwind`: every exported shim goes through [`guard`].

use crate::{ErrorBuf, STATUS_ERROR, STATUS_OK, STATUS_PANIC};
use std::panic::{catch_unwind, AssertUnwindSafe};

/// Text of a panic payload (`&str` or `String` payloads; anything else is described generically).
fn panic_text(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "panic with a non-string payload".to_string()
    }
}

/// Runs `f`, turning `Err(msg)` into [`STATUS_ERROR`] and a panic into [`STATUS_PANIC`], each with its message
/// written to `err`; returns `(status, value)` where `value` is `Some` only on success.
///
/// # Safety
/// `err` is null or a valid [`ErrorBuf`] (see [`ErrorBuf::write`]).
pub unsafe fn guard<T>(
    err: *mut ErrorBuf,
    f: impl FnOnce() -> Result<T, String>,
) -> (i32, Option<T>) {
    // SAFETY: the only unsafe calls are the two `ErrorBuf::write`s, whose requirement (`err` null or valid) is this
    // function's own precondition.
    unsafe {
        match catch_unwind(AssertUnwindSafe(f)) {
            Ok(Ok(v)) => (STATUS_OK, Some(v)),
            Ok(Err(msg)) => {
                ErrorBuf::write(err, &msg);
                (STATUS_ERROR, None)
            }
            Err(payload) => {
                ErrorBuf::write(
                    err,
                    &format!("plugin panicked: {}", panic_text(payload.as_ref())),
                );
                (STATUS_PANIC, None)
            }
        }
    }
}

/// [`guard`] for calls that return only a status.
///
/// # Safety
/// As [`guard`].
pub unsafe fn guard_status(err: *mut ErrorBuf, f: impl FnOnce() -> Result<(), String>) -> i32 {
    // SAFETY: same precondition as `guard`, which the caller upholds.
    unsafe { guard(err, f).0 }
}
