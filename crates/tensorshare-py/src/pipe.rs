//! [`PyConnection`]: an end of a tensorshare pipe of [`Value`]s, with the Python face of
//! `multiprocessing.connection.Connection` (`send`, `recv`, `poll`, `send_bytes`,
//! `recv_bytes`, `fileno`, `close`).

use std::os::fd::{AsFd, AsRawFd};
use std::sync::Mutex;
use std::time::Instant;

use pyo3::exceptions::{PyEOFError, PyOSError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use tensorshare::{pipe, Connection, Error, Value};

use crate::convert::{from_value, to_value};
use crate::to_py;
use crate::wait::{deadline_of, next_slice, SLICE};

/// An end of a pipe between processes, Python or Rust, whose values are Python values.
#[pyclass(name = "Connection", module = "tensorshare._native", frozen)]
pub struct PyConnection {
    inner: Mutex<Option<Connection<Value>>>,
    readable: bool,
    writable: bool,
}

impl PyConnection {
    pub(crate) fn from_connection(c: Connection<Value>) -> PyConnection {
        PyConnection { inner: Mutex::new(Some(c)), readable: true, writable: true }
    }

    fn end(&self) -> PyResult<Connection<Value>> {
        self.inner
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .ok_or_else(|| PyOSError::new_err("handle is closed"))
    }

    /// This end as a value (a handle to the same end).
    pub(crate) fn value(&self) -> PyResult<Value> {
        Ok(Value::Connection(self.end()?))
    }
}

/// A pair of connected ends: both duplex, or (with `duplex=False`) a reading end and a
/// writing end, as `multiprocessing.Pipe` returns them.
#[pyfunction]
#[pyo3(signature = (duplex = true))]
pub(crate) fn new_pipe(duplex: bool) -> PyResult<(PyConnection, PyConnection)> {
    let (a, b) = pipe::<Value>().map_err(to_py)?;
    let mut a = PyConnection::from_connection(a);
    let mut b = PyConnection::from_connection(b);
    if !duplex {
        a.writable = false;
        b.readable = false;
    }
    Ok((a, b))
}

#[pymethods]
impl PyConnection {
    /// Sends `obj` to the other end (tensors and arrays as handles).
    fn send(&self, py: Python<'_>, obj: &Bound<'_, PyAny>) -> PyResult<()> {
        if !self.writable {
            return Err(PyOSError::new_err("connection is read-only"));
        }
        let end = self.end()?;
        let value = to_value(py, obj)?;
        py.detach(move || end.send(value).map_err(|e| e.into_parts().1)).map_err(to_py)
    }

    /// Receives the next value; `EOFError` once the other end is closed and nothing is left.
    fn recv(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        if !self.readable {
            return Err(PyOSError::new_err("connection is write-only"));
        }
        let end = self.end()?;
        loop {
            match py.detach(|| end.recv_timeout(SLICE)) {
                Ok(v) => return from_value(py, v),
                Err(Error::Timeout) => py.check_signals()?,
                Err(Error::Disconnected) => {
                    return Err(PyEOFError::new_err("the other end of the pipe is closed"))
                }
                Err(e) => return Err(to_py(e)),
            }
        }
    }

    /// Whether something (a value, or the other end's hang-up) is ready to be received,
    /// waiting up to `timeout` seconds (`None`: until something is).
    #[pyo3(signature = (timeout = 0.0))]
    fn poll(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<bool> {
        if !self.readable {
            return Err(PyOSError::new_err("connection is write-only"));
        }
        let end = self.end()?;
        let deadline = deadline_of(true, timeout)?;
        loop {
            let slice = deadline.map_or(SLICE, next_slice);
            if py.detach(|| end.poll(slice)).map_err(to_py)? {
                return Ok(true);
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Ok(false);
            }
            py.check_signals()?;
        }
    }

    /// Sends `buf[offset:offset+size]` as one message of bytes.
    #[pyo3(signature = (buf, offset = 0, size = None))]
    fn send_bytes(&self, py: Python<'_>, buf: &[u8], offset: usize, size: Option<usize>) -> PyResult<()> {
        let end_at = match size {
            Some(n) => offset.checked_add(n),
            None => Some(buf.len()),
        };
        let slice = end_at
            .filter(|&e| offset <= e && e <= buf.len())
            .map(|e| &buf[offset..e])
            .ok_or_else(|| PyValueError::new_err("buffer length < offset + size"))?;
        let bytes = PyBytes::new(py, slice);
        self.send(py, bytes.as_any())
    }

    /// Receives one message of bytes (sent by `send_bytes`); `OSError` when it is longer
    /// than `maxlength`.
    #[pyo3(signature = (maxlength = None))]
    fn recv_bytes<'py>(&self, py: Python<'py>, maxlength: Option<usize>) -> PyResult<Bound<'py, PyAny>> {
        let got = self.recv(py)?.into_bound(py);
        let bytes =
            got.cast::<PyBytes>().map_err(|_| PyOSError::new_err("the message received is not bytes"))?;
        if maxlength.is_some_and(|m| bytes.as_bytes().len() > m) {
            return Err(PyOSError::new_err("bad message length"));
        }
        Ok(got)
    }

    /// The descriptor to wait on (`multiprocessing.connection.wait`).
    fn fileno(&self) -> PyResult<i32> {
        Ok(self.end()?.as_fd().as_raw_fd())
    }

    /// Closes this end here (other copies of it, in this or other processes, stay open).
    fn close(&self) {
        self.inner.lock().unwrap_or_else(|p| p.into_inner()).take();
    }

    #[getter]
    fn closed(&self) -> bool {
        self.inner.lock().unwrap_or_else(|p| p.into_inner()).is_none()
    }

    #[getter]
    fn readable(&self) -> bool {
        self.readable
    }

    #[getter]
    fn writable(&self) -> bool {
        self.writable
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __exit__(&self, _a: &Bound<'_, PyAny>, _b: &Bound<'_, PyAny>, _c: &Bound<'_, PyAny>) {
        self.close();
    }

    /// Pickled only as an argument of a process being started; inside tensorshare's own
    /// messages an end travels as a handle.
    fn __reduce__<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        slf.py().import("tensorshare.multiprocessing._context")?.call_method1("reduce_native", (slf,))
    }
}
