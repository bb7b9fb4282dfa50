//! [`PyConnection`]: an end of a tensorshare pipe of [`Value`]s, with the Python face of
//! `multiprocessing.connection.Connection` (`send`, `recv`, `poll`, `send_bytes`,
//! `recv_bytes`, `fileno`, `close`).

use std::os::fd::{AsFd, AsRawFd};
use std::sync::Mutex;
use std::time::Instant;

use pyo3::exceptions::{PyBrokenPipeError, PyEOFError, PyOSError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyMemoryView, PySlice};
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

    /// This end as a value (a handle to the same end). The wire's ends are duplex: an end
    /// of a one-way pipe travels as a pickled call that makes the end beside it one-way
    /// again in the receiver (`_reduction.one_way_end`), so that it refuses there what
    /// multiprocessing's refuses (a reading end's `send`, a writing end's `recv`).
    pub(crate) fn value(&self, py: Python<'_>) -> PyResult<Value> {
        let end = Value::Connection(self.end()?);
        if self.readable && self.writable {
            return Ok(end);
        }
        let pickle: Vec<u8> = py
            .import("tensorshare._reduction")?
            .call_method1("one_way_pickle", (self.readable,))?
            .extract()?;
        Ok(Value::Object { pickle, tensors: vec![end] })
    }
}

/// `buf`'s bytes as a flat memoryview of unsigned bytes (format `B`), which bytes can be
/// assigned to: any other view is cast, its items of one byte too (`b`, `c`, `?`), as a
/// view of another format takes no bytes.
fn as_bytes_view<'py>(buf: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
    let view = PyMemoryView::from(buf)?.into_any();
    if view.getattr("format")?.extract::<String>()? == "B" && view.getattr("ndim")?.extract::<usize>()? == 1 {
        return Ok(view);
    }
    view.call_method1("cast", ("B",))
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
        // Waiting for room in slices, with signal handlers run between them, as a queue's
        // put: a send to a peer that does not read is interrupted by a signal (Ctrl-C), as
        // multiprocessing's is. The message is made once.
        let mut raised = None;
        let sent = py.detach(|| {
            end.send_while(value, SLICE, || {
                Python::attach(|py| py.check_signals()).map_err(|e| raised = Some(e)).is_ok()
            })
            .map_err(|e| e.into_parts().1)
        });
        if let Some(e) = raised {
            return Err(e);
        }
        match sent {
            Ok(()) => Ok(()),
            // As multiprocessing's (the OS's EPIPE): nobody can receive what is sent.
            Err(Error::Disconnected) => {
                Err(PyBrokenPipeError::new_err("the other end of the pipe is closed"))
            }
            Err(e) => Err(to_py(e)),
        }
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

    /// Sends bytes `offset..offset + size` of `buf` (any object with the buffer protocol:
    /// `bytes`, `bytearray`, `memoryview`, `array`, a numpy array, read as bytes) as one
    /// message of bytes; `ValueError` for an offset or size outside it, as multiprocessing.
    #[pyo3(signature = (buf, offset = 0, size = None))]
    fn send_bytes(
        &self,
        py: Python<'_>,
        buf: &Bound<'_, PyAny>,
        offset: i64,
        size: Option<i64>,
    ) -> PyResult<()> {
        let bytes = as_bytes_view(buf)?;
        let n = i64::try_from(bytes.len()?).map_err(|_| PyValueError::new_err("buffer too large"))?;
        if offset < 0 {
            return Err(PyValueError::new_err("offset is negative"));
        }
        if n < offset {
            return Err(PyValueError::new_err("buffer length < offset"));
        }
        let size = match size {
            None => n - offset,
            Some(s) if s < 0 => return Err(PyValueError::new_err("size is negative")),
            Some(s) if offset.checked_add(s).is_none_or(|e| e > n) => {
                return Err(PyValueError::new_err("buffer length < offset + size"))
            }
            Some(s) => s,
        };
        let part = bytes.get_item(PySlice::new(py, offset as isize, (offset + size) as isize, 1))?;
        let part = part.call_method0("tobytes")?;
        self.send(py, &part)
    }

    /// Receives one message of bytes into `buf` (a writable buffer) from byte `offset` on,
    /// and returns its length, as multiprocessing's: `multiprocessing.BufferTooShort`, which
    /// holds the message, when it does not fit (the message is taken all the same).
    #[pyo3(signature = (buf, offset = 0))]
    fn recv_bytes_into(&self, py: Python<'_>, buf: &Bound<'_, PyAny>, offset: i64) -> PyResult<usize> {
        // Everything that can refuse `buf` is asked before a message is taken, which would
        // be lost.
        let bytes = as_bytes_view(buf)?;
        if bytes.getattr("readonly")?.extract::<bool>()? {
            return Err(PyTypeError::new_err("recv_bytes_into needs a writable buffer"));
        }
        let n = i64::try_from(bytes.len()?).map_err(|_| PyValueError::new_err("buffer too large"))?;
        if offset < 0 {
            return Err(PyValueError::new_err("negative offset"));
        }
        if offset > n {
            return Err(PyValueError::new_err("offset too large"));
        }
        let got = self.recv_bytes(py, None)?;
        let size = got.len()?;
        let end = usize::try_from(offset).ok().and_then(|o| o.checked_add(size));
        if end.is_none_or(|e| e > n as usize) {
            let short = py.import("multiprocessing")?.getattr("BufferTooShort")?;
            return Err(PyErr::from_value(short.call1((got,))?));
        }
        bytes.set_item(PySlice::new(py, offset as isize, end.unwrap_or(0) as isize, 1), got)?;
        Ok(size)
    }

    /// Receives one message of bytes (sent by `send_bytes`); `OSError` when it is longer
    /// than `maxlength`. A value sent by `send` arrives as its pickle, as with
    /// multiprocessing, whose `send` is `send_bytes` of the pickle (it was an error, and the
    /// value was lost).
    #[pyo3(signature = (maxlength = None))]
    fn recv_bytes<'py>(&self, py: Python<'py>, maxlength: Option<usize>) -> PyResult<Bound<'py, PyAny>> {
        let got = self.recv(py)?.into_bound(py);
        let got = match got.cast::<PyBytes>() {
            Ok(_) => got,
            Err(_) => {
                let pickler = py.import("multiprocessing.reduction")?.getattr("ForkingPickler")?;
                pickler.call_method1("dumps", (got,))?.call_method0("tobytes")?
            }
        };
        if maxlength.is_some_and(|m| got.len().is_ok_and(|n| n > m)) {
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

    /// Another handle to this end, reading only (`readable`) or writing only: a received
    /// end of a one-way pipe (see [`PyConnection::value`]).
    fn _one_way(&self, readable: bool) -> PyResult<PyConnection> {
        Ok(PyConnection { inner: Mutex::new(Some(self.end()?)), readable, writable: !readable })
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
