//! Waiting from Python: deadlines from `block` and `timeout` arguments, and waits cut into
//! slices between which Python runs its signal handlers (so Ctrl-C interrupts a `get`).

use std::time::{Duration, Instant};

use pyo3::exceptions::PyValueError;
use pyo3::PyResult;

/// How long one wait lasts before Python gets to run its signal handlers.
pub(crate) const SLICE: Duration = Duration::from_millis(100);

/// The deadline of a wait: now when not `block`, never (`None`) without a `timeout`. As in
/// multiprocessing, a timeout of zero or less is a look that does not wait (so the usual
/// `timeout=deadline - time.monotonic()` of a deadline already passed raises `Empty`, not an
/// error); an infinite one waits for good (where multiprocessing raises `OverflowError`);
/// NaN is an error, as there.
pub(crate) fn deadline_of(block: bool, timeout: Option<f64>) -> PyResult<Option<Instant>> {
    if !block {
        return Ok(Some(Instant::now()));
    }
    match timeout {
        None => Ok(None),
        Some(t) if t.is_nan() => Err(PyValueError::new_err("'timeout' must be a number, got nan")),
        Some(t) if t == f64::INFINITY => Ok(None),
        Some(t) => Ok(Some(Instant::now() + Duration::from_secs_f64(t.clamp(0.0, 1e9)))),
    }
}

/// The next slice of a wait that ends at `deadline` (zero once it has passed).
pub(crate) fn next_slice(deadline: Instant) -> Duration {
    deadline.saturating_duration_since(Instant::now()).min(SLICE)
}
