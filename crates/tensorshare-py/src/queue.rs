//! [`PyQueue`]: a tensorshare queue of [`Value`]s, with the Python face of
//! `multiprocessing.Queue` (`put`/`get` with `block` and `timeout`, `queue.Empty` and
//! `queue.Full`) and what multiprocessing's Pool needs of a queue (`poll`, `fileno`).

use std::collections::VecDeque;
use std::mem::ManuallyDrop;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use pyo3::exceptions::{PyOSError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyType};
use tensorshare::{Error, Message, Queue, SimpleQueue, Value};

use crate::convert::{from_value, to_value};
use crate::to_py;
use crate::wait::{deadline_of, next_slice, SLICE};

#[derive(Clone)]
enum Inner {
    Queue(Queue<Value>),
    Simple(SimpleQueue<Value>),
}

/// A queue between processes, Python or Rust, whose values are Python values.
#[pyclass(name = "Queue", module = "tensorshare._native", frozen)]
pub struct PyQueue {
    /// Taken by `drop` (see there), and by nothing else.
    inner: ManuallyDrop<Inner>,
    /// Values `poll` took off the queue, which this process's next `get`s return first.
    stash: Stash,
}

impl Inner {
    fn has_unwritten(&self) -> bool {
        match self {
            Inner::Queue(q) => q.has_unwritten(),
            Inner::Simple(q) => q.has_unwritten(),
        }
    }
}

impl Drop for PyQueue {
    /// Dropping a queue's last handle in a process waits for what the process put and could
    /// not write yet, while another process or a message in flight could still read it. A
    /// Python queue is dropped where the GC lets it go, holding the GIL, and the reader may
    /// be this very process (a message carrying the queue, waiting in another of its
    /// queues): waiting there could hang it for good. So such a handle is dropped on a
    /// thread of its own, as multiprocessing's feeder writes on after its queue is
    /// collected, and the process waits for those threads before it leaves
    /// ([`wait_dropped`]: `flush_queues`, and an exit handler).
    fn drop(&mut self) {
        // SAFETY: `drop` runs once, and `self.inner` is used by nothing after it.
        let inner = unsafe { ManuallyDrop::take(&mut self.inner) };
        // Once the process is leaving (`wait_dropped` at exit has run), the queues that go
        // as the interpreter ends are dropped here, waiting, as before: nothing would join
        // a thread.
        if !inner.has_unwritten() || LEAVING.load(Ordering::SeqCst) {
            return;
        }
        let spawned = std::thread::Builder::new().name("tensorshare-drop".into()).spawn(move || drop(inner));
        // Without a thread (none can be made), the handle was dropped here, waiting.
        if let Ok(handle) = spawned {
            let mut dropping = DROPPING.lock().unwrap_or_else(|p| p.into_inner());
            keep_own(&mut dropping);
            dropping.push((std::process::id(), handle));
        }
    }
}

/// The threads dropping queues (see `PyQueue`'s `drop`), with the process that started each.
/// Used with the GIL held only (the GC's drops, `wait_dropped`), so no fork (which Python
/// makes with the GIL held) finds the lock taken.
static DROPPING: Mutex<Vec<(u32, JoinHandle<()>)>> = Mutex::new(Vec::new());

/// Keeps only this process's own threads in `dropping`: in a forked child the parent's are
/// not there, and their handles are forgotten, never joined or detached.
fn keep_own(dropping: &mut Vec<(u32, JoinHandle<()>)>) {
    let me = std::process::id();
    let (mine, theirs): (Vec<_>, Vec<_>) =
        std::mem::take(dropping).into_iter().partition(|(pid, _)| *pid == me);
    theirs.into_iter().for_each(std::mem::forget);
    // Finished ones go (their handles detach a thread that has ended).
    dropping.extend(mine.into_iter().filter(|(_, h)| !h.is_finished()));
}

/// Set by the exit handler's `wait_dropped`: queues dropped after it are dropped in place.
static LEAVING: AtomicBool = AtomicBool::new(false);

/// Waits until every queue this process dropped with values unwritten is dropped, its
/// values written out while another process could read them. `leaving`: the process is
/// ending (the exit handler), and later drops wait in place.
pub(crate) fn wait_dropped(py: Python<'_>, leaving: bool) {
    if leaving {
        LEAVING.store(true, Ordering::SeqCst);
    }
    let handles = {
        let mut dropping = DROPPING.lock().unwrap_or_else(|p| p.into_inner());
        keep_own(&mut dropping);
        std::mem::take(&mut *dropping)
    };
    py.detach(|| {
        for (_, h) in handles {
            let _ = h.join();
        }
    });
}

/// Values `poll` took off a queue for the process that polled. A child forked meanwhile
/// inherits a copy of them, which is not its own: the parent gets them, so the child lets
/// its copy go (the core makes dropping values inherited through fork harmless to the
/// parent's holds). The process is asked only when there is something stashed.
#[derive(Default)]
struct Stash(Mutex<(u32, VecDeque<Value>)>);

impl Stash {
    fn with<R>(&self, f: impl FnOnce(&mut VecDeque<Value>) -> R) -> R {
        let mut g = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if !g.1.is_empty() && g.0 != std::process::id() {
            g.1.clear();
        }
        f(&mut g.1)
    }

    fn push(&self, v: Value) {
        let pid = std::process::id();
        let mut g = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if g.0 != pid {
            g.1.clear();
            g.0 = pid;
        }
        g.1.push_back(v);
    }
}

/// Descriptors kept open until a child process has its copies (see [`export`]).
#[pyclass(module = "tensorshare._native", frozen)]
pub struct Parcel {
    #[allow(dead_code)] // held for its descriptors' lifetime
    fds: Vec<OwnedFd>,
}

/// `obj` as bytes and descriptors, for a child process that gets the descriptors some
/// other way (multiprocessing's `pass_fds` or fork server): `(bytes, fds, parcel)`; the
/// descriptors stay open as long as `parcel` lives. What the value names in shared memory
/// is held by the descriptors, so the sender may exit once the child has them.
#[pyfunction]
pub(crate) fn export<'py>(
    py: Python<'py>,
    obj: &Bound<'py, PyAny>,
) -> PyResult<(Bound<'py, PyBytes>, Vec<i32>, Parcel)> {
    let value = to_value(py, obj)?;
    let (bytes, fds) = py.detach(move || Message::encode(&value)).map_err(to_py)?.into_parts();
    let raw = fds.iter().map(AsRawFd::as_raw_fd).collect();
    Ok((PyBytes::new(py, &bytes), raw, Parcel { fds }))
}

/// The value [`export`] described, from its bytes and descriptors (duplicated here: the
/// caller still owns, and closes, its own).
#[pyfunction]
#[pyo3(name = "import_")]
pub(crate) fn import(py: Python<'_>, bytes: &[u8], fds: Vec<i32>) -> PyResult<Py<PyAny>> {
    let mut owned = Vec::with_capacity(fds.len());
    for fd in fds {
        // SAFETY: fcntl(F_DUPFD_CLOEXEC) only reads the descriptor table; on an fd that is
        // not open it fails with EBADF, handled below.
        let dup = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0) };
        if dup < 0 {
            return Err(PyOSError::new_err(format!(
                "descriptor {fd} of a value sent to this process: {}",
                std::io::Error::last_os_error()
            )));
        }
        // SAFETY: `dup` was just made by fcntl above and nothing else refers to it.
        owned.push(unsafe { OwnedFd::from_raw_fd(dup) });
    }
    let message = Message::from_parts(bytes.to_vec(), owned);
    let value = py.detach(move || message.decode::<Value>()).map_err(to_py)?;
    from_value(py, value)
}

fn deadline_error(py: Python<'_>, class: &str) -> PyErr {
    match py.import("queue").and_then(|m| m.getattr(class)) {
        Ok(cls) => match cls.cast_into::<PyType>() {
            Ok(cls) => PyErr::from_type(cls, ()),
            // A program replaced it: say what happened rather than panic.
            Err(_) => PyTypeError::new_err(format!(
                "the deadline passed, and queue.{class} is not a class to raise"
            )),
        },
        Err(e) => e,
    }
}

impl PyQueue {
    pub(crate) fn from_queue(q: Queue<Value>) -> PyQueue {
        PyQueue { inner: ManuallyDrop::new(Inner::Queue(q)), stash: Stash::default() }
    }

    pub(crate) fn from_simple(q: SimpleQueue<Value>) -> PyQueue {
        PyQueue { inner: ManuallyDrop::new(Inner::Simple(q)), stash: Stash::default() }
    }

    /// This queue as a value (a handle to the same queue).
    pub(crate) fn value(&self) -> Value {
        match &*self.inner {
            Inner::Queue(q) => Value::Queue(q.clone()),
            Inner::Simple(q) => Value::SimpleQueue(q.clone()),
        }
    }

    fn stashed(&self) -> Option<Value> {
        self.stash.with(VecDeque::pop_front)
    }

    fn get_timeout(&self, t: Duration) -> tensorshare::Result<Value> {
        match &*self.inner {
            Inner::Queue(q) => q.get_timeout(t),
            Inner::Simple(q) => q.get_timeout(t),
        }
    }

    fn try_get(&self) -> tensorshare::Result<Option<Value>> {
        match &*self.inner {
            Inner::Queue(q) => q.try_get(),
            Inner::Simple(q) => q.try_get(),
        }
    }

    /// The next value, waiting until `deadline` (`None`: as long as it takes), in slices
    /// between which Python may raise `KeyboardInterrupt`. `Ok(None)` at the deadline.
    fn wait(&self, py: Python<'_>, deadline: Option<Instant>) -> PyResult<Option<Value>> {
        if let Some(v) = self.stashed() {
            return Ok(Some(v));
        }
        loop {
            let slice = match deadline {
                None => SLICE,
                Some(d) => next_slice(d),
            };
            let got =
                py.detach(
                    || if slice.is_zero() { self.try_get() } else { self.get_timeout(slice).map(Some) },
                );
            match got {
                Ok(Some(v)) => return Ok(Some(v)),
                Ok(None) => return Ok(None),
                Err(Error::Timeout) if deadline.is_some_and(|d| Instant::now() >= d) => return Ok(None),
                Err(Error::Timeout) => py.check_signals()?,
                // No other handle can put now; but this process may still put (Python's
                // queues are both ends, and threads share them), so wait as Python's own
                // queues do: until something arrives or the deadline.
                // Not by waiting on `fileno`: that would route the queue's values through its
                // socket from then on, where `empty` cannot tell a value from a wake-up
                // without taking it. Naps instead: this process's own puts are rare here.
                Err(Error::Disconnected) => {
                    if slice.is_zero() || deadline.is_some_and(|d| Instant::now() >= d) {
                        return Ok(None);
                    }
                    py.detach(|| std::thread::sleep(slice.min(ALONE_NAP)));
                    py.check_signals()?;
                }
                Err(e) => return Err(to_py(e)),
            }
        }
    }
}

/// How long a `get` on a queue no other process holds naps between looks for what this
/// process's other threads put.
const ALONE_NAP: Duration = Duration::from_millis(5);

#[pymethods]
impl PyQueue {
    /// A new queue: bounded to `maxsize` values when `maxsize > 0`; `simple` makes a
    /// `SimpleQueue` (unbounded, `put` never waits).
    #[new]
    #[pyo3(signature = (maxsize = 0, simple = false))]
    fn new(maxsize: i64, simple: bool) -> PyResult<PyQueue> {
        let inner = if simple {
            Inner::Simple(SimpleQueue::new().map_err(to_py)?)
        } else if maxsize <= 0 {
            Inner::Queue(Queue::new().map_err(to_py)?)
        } else {
            let cap = usize::try_from(maxsize).map_err(|_| PyValueError::new_err("maxsize too large"))?;
            Inner::Queue(Queue::with_capacity(cap).map_err(to_py)?)
        };
        Ok(PyQueue { inner: ManuallyDrop::new(inner), stash: Stash::default() })
    }

    /// Puts `obj`: tensors and arrays travel as handles to shared memory (a tensor not yet in
    /// shared memory is moved there first, in place). A bounded queue that stays full
    /// until the deadline raises `queue.Full`.
    #[pyo3(signature = (obj, block = true, timeout = None))]
    fn put(&self, py: Python<'_>, obj: &Bound<'_, PyAny>, block: bool, timeout: Option<f64>) -> PyResult<()> {
        let mut value = to_value(py, obj)?;
        let deadline = deadline_of(block, timeout)?;
        let q = match &*self.inner {
            Inner::Simple(q) => {
                return py.detach(move || q.put(value).map_err(|e| e.into_parts().1)).map_err(to_py)
            }
            Inner::Queue(q) => q,
        };
        loop {
            let slice = match deadline {
                None => SLICE,
                Some(d) => next_slice(d),
            };
            let sent = py.detach(move || {
                if slice.is_zero() { q.try_put(value) } else { q.put_timeout(value, slice) }.map_err(Box::new)
            });
            let (back, e) = match sent {
                Ok(()) => return Ok(()),
                Err(e) => e.into_parts(),
            };
            let past = deadline.is_some_and(|d| Instant::now() >= d);
            match e {
                Error::Timeout if past => return Err(deadline_error(py, "Full")),
                Error::Timeout => {}
                // Full, and no other handle can take: only this process can make room (a
                // thread of it may get), and nothing signals that, so look again shortly.
                Error::Disconnected if past || slice.is_zero() => return Err(deadline_error(py, "Full")),
                Error::Disconnected => py.detach(|| std::thread::sleep(slice.min(Duration::from_millis(10)))),
                e => return Err(to_py(e)),
            }
            py.check_signals()?;
            value = back;
        }
    }

    /// Takes the next value; `queue.Empty` when none comes before the deadline. As Python's
    /// own queues do, it waits on when no other handle of the queue is left anywhere (this
    /// process may still put): give a timeout to a `get` whose producers may die.
    #[pyo3(signature = (block = true, timeout = None))]
    fn get(&self, py: Python<'_>, block: bool, timeout: Option<f64>) -> PyResult<Py<PyAny>> {
        match self.wait(py, deadline_of(block, timeout)?)? {
            Some(v) => from_value(py, v),
            None => Err(deadline_error(py, "Empty")),
        }
    }

    /// Whether a value is ready, waiting up to `timeout` seconds (`None`: until one is). The
    /// value stays first in line for this process's next `get`.
    #[pyo3(signature = (timeout = 0.0))]
    fn poll(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<bool> {
        if !self.stash.with(|s| s.is_empty()) {
            return Ok(true);
        }
        match self.wait(py, deadline_of(true, timeout)?)? {
            Some(v) => {
                self.stash.push(v);
                Ok(true)
            }
            None => Ok(false),
        }
    }

    /// About how many values wait (Python's `qsize`): see `tensorshare::Queue::len`. Values
    /// `poll` took off the queue for this process count too.
    fn qsize(&self) -> usize {
        let stashed = self.stash.with(|s| s.len());
        stashed
            + match &*self.inner {
                Inner::Queue(q) => q.len(),
                Inner::Simple(q) => q.len(),
            }
    }

    /// Lets this process leave without waiting for what it put to be written out (see
    /// `tensorshare::Queue::cancel_join_thread`).
    fn cancel_join_thread(&self) {
        match &*self.inner {
            Inner::Queue(q) => q.cancel_join_thread(),
            Inner::Simple(q) => q.cancel_join_thread(),
        }
    }

    /// Whether a bounded queue has no free place now (a `put` would wait).
    fn full(&self) -> bool {
        match &*self.inner {
            Inner::Queue(q) => q.is_full(),
            Inner::Simple(q) => q.is_full(),
        }
    }

    /// The queue's capacity, 0 when it has none (Python's `maxsize`).
    #[getter]
    fn maxsize(&self) -> usize {
        match &*self.inner {
            Inner::Queue(q) => q.capacity(),
            Inner::Simple(q) => q.capacity(),
        }
        .unwrap_or(0)
    }

    /// Whether no value is ready now, told without taking one off the queue, which other
    /// processes may be reading (a value taken here would be this process's alone). Only
    /// where the queue cannot tell without taking (a record in its socket while someone
    /// waits on `fileno`, which may be a wake-up with no value: multiprocessing's Pool
    /// waits so on its own queues) does it look as `poll` does, and keep the value for
    /// this process's next `get`.
    fn empty(&self, py: Python<'_>) -> PyResult<bool> {
        if !self.stash.with(|s| s.is_empty()) {
            return Ok(false);
        }
        let ready = match &*self.inner {
            Inner::Queue(q) => q.has_ready(),
            Inner::Simple(q) => q.has_ready(),
        };
        match ready {
            Some(ready) => Ok(!ready),
            None => Ok(!self.poll(py, Some(0.0))?),
        }
    }

    /// A descriptor that becomes readable when a value may be waiting (for
    /// `multiprocessing.connection.wait`).
    fn fileno(&self) -> i32 {
        match &*self.inner {
            Inner::Queue(q) => q.poll_fd().as_raw_fd(),
            Inner::Simple(q) => q.poll_fd().as_raw_fd(),
        }
    }

    /// Whether this is a `SimpleQueue`.
    #[getter]
    fn simple(&self) -> bool {
        matches!(*self.inner, Inner::Simple(_))
    }

    /// Pickled only as an argument of a process being started (its descriptors then go to
    /// the child with it); inside tensorshare's own messages a queue travels as a handle.
    fn __reduce__<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        slf.py().import("tensorshare.multiprocessing._context")?.call_method1("reduce_native", (slf,))
    }

    /// Names the queue by its object, not by `fileno` (which would route its values through
    /// its socket from then on: see `empty`).
    fn __repr__(slf: &Bound<'_, Self>) -> String {
        format!(
            "<tensorshare {} at {:#x}>",
            if slf.get().simple() { "SimpleQueue" } else { "Queue" },
            slf.as_ptr() as usize
        )
    }
}
