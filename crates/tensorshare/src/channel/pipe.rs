//! [`pipe`] and [`Connection`]: a two-ended, duplex channel between two processes.

use std::marker::PhantomData;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;
use std::time::Duration;

use rustix::event::PollFlags;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::err::SendError;
use super::frame::Outgoing;
use super::socket::{self, Deadline};
use crate::wire::{self, FdSource};
use crate::{Error, Result};

/// One end of a [`pipe`]. What one end sends, the other receives. When every copy of the
/// other end is closed (its process exited or was killed), `recv` gives `Disconnected`.
pub struct Connection<T> {
    fd: Arc<OwnedFd>,
    _t: PhantomData<fn(T) -> T>,
}

/// A connected pair of ends (torch's `Pipe(duplex=True)`).
pub fn pipe<T: Serialize + DeserializeOwned>() -> Result<(Connection<T>, Connection<T>)> {
    let (a, b) = socket::pair()?;
    Ok((Connection { fd: Arc::new(a), _t: PhantomData }, Connection { fd: Arc::new(b), _t: PhantomData }))
}

/// Waiting on a connection needs no liveness check: the peer's exit closes its end, and
/// the socket reports that by itself. So the peer always counts as possibly alive.
fn no_liveness_check() -> bool {
    true
}

impl<T: Serialize + DeserializeOwned> Connection<T> {
    /// Sends a value to the other end, waiting while its socket is full. A failure
    /// (`Disconnected` once the other end is closed) gives the value back.
    pub fn send(&self, value: T) -> std::result::Result<(), SendError<T>> {
        self.send_deadline(value, Deadline::after(None))
    }

    /// [`send`](Connection::send), waiting at most `timeout` while the other end's socket
    /// is full: `Timeout` then gives the value back, and nothing of it was sent (a message
    /// is one record of the socket), so a caller may look at other things (a signal) and
    /// send it again.
    pub fn send_timeout(&self, value: T, timeout: Duration) -> std::result::Result<(), SendError<T>> {
        self.send_deadline(value, Deadline::after(Some(timeout)))
    }

    /// [`send`](Connection::send), asking `go_on` every `slice` it waits for room whether to
    /// wait on: `false` ends the send with `Timeout`, the value back and nothing of it sent
    /// (a binding runs signal handlers there). The message is made once, however long it
    /// waits: a large one is not written into a new memfd every slice.
    pub fn send_while(
        &self,
        value: T,
        slice: Duration,
        mut go_on: impl FnMut() -> bool,
    ) -> std::result::Result<(), SendError<T>> {
        let mut out = match wire::encode(&value).and_then(Outgoing::new) {
            Ok(out) => out,
            Err(e) => return Err(SendError::new(value, e)),
        };
        loop {
            let deadline = Deadline::after(Some(slice));
            match socket::send_framed(self.fd.as_fd(), &mut out, deadline, &no_liveness_check) {
                Ok(()) => return Ok(()),
                Err(Error::Timeout) if go_on() => {}
                Err(e) => return Err(SendError::new(value, e)),
            }
        }
    }

    fn send_deadline(&self, value: T, deadline: Deadline) -> std::result::Result<(), SendError<T>> {
        let sent = wire::encode(&value)
            .and_then(|msg| socket::send(self.fd.as_fd(), msg, deadline, &no_liveness_check));
        sent.map_err(|e| SendError::new(value, e))
    }

    /// Receives a value, waiting as long as it takes.
    pub fn recv(&self) -> Result<T> {
        self.recv_deadline(Deadline::after(None))
    }

    /// Receives a value, waiting at most `timeout`.
    pub fn recv_timeout(&self, timeout: Duration) -> Result<T> {
        self.recv_deadline(Deadline::after(Some(timeout)))
    }

    fn recv_deadline(&self, deadline: Deadline) -> Result<T> {
        super::ready_to_receive()?;
        let r = socket::recv(self.fd.as_fd(), deadline, &no_liveness_check)?;
        r.decode_received()
    }

    /// Whether a value (or the hang-up of the other end) is waiting, after waiting at most
    /// `timeout` (torch's `poll`).
    pub fn poll(&self, timeout: Duration) -> Result<bool> {
        socket::wait(self.fd.as_fd(), PollFlags::IN, timeout)
    }
}

impl<T> Connection<T> {
    pub(crate) fn socket(&self) -> &Arc<OwnedFd> {
        &self.fd
    }

    /// One end over a connected AF_UNIX SOCK_SEQPACKET socket made elsewhere (accepted on a
    /// listening socket, or connected to one): what the peer sends, this end receives.
    #[cfg_attr(not(feature = "mpi"), allow(dead_code))]
    pub(crate) fn from_socket(fd: OwnedFd) -> Connection<T> {
        Connection { fd: Arc::new(fd), _t: PhantomData }
    }
}

/// The socket. Writing to it directly bypasses the codec (a test of a hostile peer does);
/// the other end checks everything it receives, so such bytes can only reach it as errors.
impl<T> std::os::fd::AsFd for Connection<T> {
    fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

impl<T> Clone for Connection<T> {
    fn clone(&self) -> Self {
        Connection { fd: self.fd.clone(), _t: PhantomData }
    }
}

impl<T> std::fmt::Debug for Connection<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connection").finish_non_exhaustive()
    }
}

impl<T> Serialize for Connection<T> {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        if !wire::encoding() {
            return Err(wire::ser_error("a connection can only travel inside a tensorshare message"));
        }
        wire::encode_fd(FdSource::Fd(self.fd.clone())).map_err(wire::ser_error)?.serialize(s)
    }
}

impl<'de, T> Deserialize<'de> for Connection<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let i = u32::deserialize(d)?;
        let fd = wire::decode_fd(i).map_err(wire::de_error)?;
        let st = rustix::fs::fstat(&fd).map_err(|e| wire::de_error(Error::io("fstat of a connection", e)))?;
        if rustix::fs::FileType::from_raw_mode(st.st_mode) != rustix::fs::FileType::Socket {
            return Err(wire::de_error("a connection endpoint that is not a socket"));
        }
        Ok(Connection { fd: Arc::new(fd), _t: PhantomData })
    }
}
