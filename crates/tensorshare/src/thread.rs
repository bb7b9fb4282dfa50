//! Thread names (torch's `_set_thread_name` / `_get_thread_name`).

use std::ffi::CString;

use crate::{Error, Result};

/// Longest name Linux keeps, in bytes (16 with the terminating NUL).
pub const MAX_THREAD_NAME: usize = 15;

/// Names the calling thread, as `top`, `ps -L` and debuggers show it. A name longer than
/// 15 bytes, or one holding a NUL, is an error rather than cut short silently.
pub fn set_thread_name(name: &str) -> Result<()> {
    if name.len() > MAX_THREAD_NAME {
        return Err(Error::Parse(format!(
            "thread name {name:?} is {} bytes; Linux keeps at most {MAX_THREAD_NAME}",
            name.len()
        )));
    }
    let c = CString::new(name).map_err(|_| Error::Parse("a thread name cannot contain NUL".into()))?;
    rustix::thread::set_name(&c).map_err(|e| Error::io("prctl(PR_SET_NAME)", e))
}

/// The calling thread's name.
pub fn get_thread_name() -> Result<String> {
    let c = rustix::thread::name().map_err(|e| Error::io("prctl(PR_GET_NAME)", e))?;
    Ok(c.to_string_lossy().into_owned())
}
