//! Records over AF_UNIX SOCK_SEQPACKET sockets, with descriptors (SCM_RIGHTS).
//!
//! A SEQPACKET socket keeps record boundaries and delivers each record whole to one
//! reader, so many writers and readers in many processes can share one socket without
//! interleaving. How a message becomes one record is `frame`'s business.

use std::io::{IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::time::{Duration, Instant};

use rustix::event::{PollFd, PollFlags};
use rustix::io::Errno;
use rustix::net::{
    AddressFamily, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags, SocketFlags, SocketType,
};

use super::awake::watch;
pub(crate) use super::awake::{Awake, Bell, Patience};
use super::frame::{Outgoing, MAX_FDS, MAX_INLINE};
use crate::wire::Encoded;
use crate::{Error, Result};
/// How often a blocked call checks that its peers are still alive.
const LIVENESS_SLICE: Duration = Duration::from_millis(50);
/// How long a receive polls the socket before it sleeps. Waking a sleeping process costs
/// more than a small message's whole trip, so a reply that comes within this window is
/// picked up without a sleep and a wake-up.
pub(crate) const SPIN: Duration = Duration::from_micros(50);

/// A connected pair of non-blocking SEQPACKET sockets.
pub(crate) fn pair() -> Result<(OwnedFd, OwnedFd)> {
    let (a, b) = rustix::net::socketpair(
        AddressFamily::UNIX,
        SocketType::SEQPACKET,
        SocketFlags::CLOEXEC | SocketFlags::NONBLOCK,
        None,
    )
    .map_err(|e| Error::io("socketpair(AF_UNIX, SOCK_SEQPACKET)", e))?;
    Ok((a, b))
}

/// When a blocked call gives up: at a deadline, or never.
#[derive(Clone, Copy)]
pub(crate) struct Deadline(Option<Instant>);

impl Deadline {
    pub(crate) fn after(timeout: Option<Duration>) -> Deadline {
        Deadline(timeout.map(|t| Instant::now() + t))
    }

    pub(crate) fn now() -> Deadline {
        Deadline(Some(Instant::now()))
    }

    /// Whether the deadline has passed at `now`.
    pub(super) fn passed(&self, now: Instant) -> bool {
        self.0.is_some_and(|d| now >= d)
    }

    /// The next wait: until the deadline, at most one liveness slice. `None`: passed.
    pub(crate) fn slice(&self) -> Option<Duration> {
        match self.0 {
            None => Some(LIVENESS_SLICE),
            Some(d) => {
                let left = d.saturating_duration_since(Instant::now());
                (!left.is_zero()).then(|| left.min(LIVENESS_SLICE))
            }
        }
    }
}

/// Waits until `fd` is ready for `flags`, or the slice passes. Returns whether it is ready.
pub(crate) fn wait(fd: BorrowedFd<'_>, flags: PollFlags, slice: Duration) -> Result<bool> {
    let ts = rustix::event::Timespec { tv_sec: slice.as_secs() as i64, tv_nsec: slice.subsec_nanos() as i64 };
    let mut fds = [PollFd::from_borrowed_fd(fd, flags)];
    match rustix::event::poll(&mut fds, Some(&ts)) {
        Ok(n) => Ok(n > 0),
        Err(Errno::INTR) => Ok(false),
        Err(e) => Err(Error::io("poll", e)),
    }
}

/// Sends `msg` as one record, waiting while the socket is full. `alive` says whether a
/// reader can still exist; when it says no while the call waits, the result is
/// `Disconnected`.
pub(crate) fn send(
    fd: BorrowedFd<'_>,
    msg: Encoded,
    deadline: Deadline,
    alive: &dyn Fn() -> bool,
) -> Result<()> {
    send_outgoing(fd, Outgoing::new(msg)?, deadline, alive)
}

/// [`send`] of a message already framed.
pub(crate) fn send_outgoing(
    fd: BorrowedFd<'_>,
    mut out: Outgoing,
    deadline: Deadline,
    alive: &dyn Fn() -> bool,
) -> Result<()> {
    send_framed(fd, &mut out, deadline, alive)
}

/// [`send_outgoing`] that leaves the message with the caller, sent or not: one that could
/// not be sent (`Disconnected`) can go to another socket.
pub(crate) fn send_framed(
    fd: BorrowedFd<'_>,
    out: &mut Outgoing,
    deadline: Deadline,
    alive: &dyn Fn() -> bool,
) -> Result<()> {
    loop {
        match send_record(fd, out.parts(), &out.fds()) {
            Ok(()) => return Ok(()),
            Err(Errno::AGAIN) => {}
            Err(Errno::MSGSIZE) if !out.is_spilled() => {
                out.spill()?;
                continue;
            }
            Err(Errno::PIPE) | Err(Errno::CONNRESET) | Err(Errno::NOTCONN) => {
                return Err(Error::Disconnected)
            }
            Err(e) => return Err(Error::io("sendmsg", e)),
        }
        let Some(slice) = deadline.slice() else { return Err(Error::Timeout) };
        if !wait(fd, PollFlags::OUT, slice)? && !alive() {
            return Err(Error::Disconnected);
        }
    }
}

/// One record of `parts` with `fds` attached (at most MAX_FDS), without waiting.
pub(crate) fn send_record(
    fd: BorrowedFd<'_>,
    parts: [&[u8]; 2],
    fds: &[BorrowedFd<'_>],
) -> rustix::io::Result<()> {
    let [head, payload] = parts;
    let iov = [IoSlice::new(head), IoSlice::new(payload)];
    let mut space = vec![MaybeUninit::<u8>::uninit(); SendAncillaryMessage::ScmRights(fds).size()];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !fds.is_empty() && !control.push(SendAncillaryMessage::ScmRights(fds)) {
        return Err(Errno::NOBUFS);
    }
    let n = rustix::net::sendmsg(fd, &iov, &mut control, SendFlags::DONTWAIT | SendFlags::NOSIGNAL)?;
    // A SEQPACKET record is sent whole or not at all.
    debug_assert_eq!(n, head.len() + payload.len());
    Ok(())
}

/// One received record.
pub(crate) struct Record {
    pub(crate) bytes: Vec<u8>,
    pub(crate) fds: Vec<OwnedFd>,
}

impl Record {
    /// The message this record carries, as a value (holds taken at once: see
    /// `frame::decode`).
    pub(crate) fn decode<T: serde::de::DeserializeOwned>(self) -> Result<T> {
        super::frame::decode(self, false)
    }

    /// The message a queue or a pipe received, as a value (holds borrowed for a while).
    pub(crate) fn decode_received<T: serde::de::DeserializeOwned>(self) -> Result<T> {
        super::frame::decode(self, true)
    }
}

/// What a receive attempt found.
pub(crate) enum Received {
    Record(Record),
    /// A record was taken off the socket but cannot be a message (its descriptors were cut
    /// off, it was too long, or it was empty); what it carried is closed.
    Bad(Error),
    /// Every writer's end is closed.
    Closed,
    /// Nothing yet.
    Empty,
}

/// Takes one record if one is waiting (never blocks).
pub(crate) fn try_recv(fd: BorrowedFd<'_>) -> Result<Received> {
    thread_local! {
        // Room for the largest inline record and a little more to detect anything larger,
        // kept per thread so that a receive allocates only what it returns.
        static BUF: std::cell::RefCell<(Vec<u8>, Vec<MaybeUninit<u8>>)> = std::cell::RefCell::new((
            vec![0u8; MAX_INLINE + 1024],
            vec![MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))],
        ));
    }
    BUF.with(|b| {
        let mut b = b.borrow_mut();
        let (bytes, space) = &mut *b;
        try_recv_into(fd, bytes, space)
    })
}

fn try_recv_into(fd: BorrowedFd<'_>, bytes: &mut [u8], space: &mut [MaybeUninit<u8>]) -> Result<Received> {
    let mut control = RecvAncillaryBuffer::new(space);
    let cap = bytes.len();
    // Past the descriptor limit the kernel drops the record's descriptors, and the message.
    crate::shm::fd_reserve::headroom();
    let mut iov = [IoSliceMut::new(bytes)];
    let r =
        match rustix::net::recvmsg(fd, &mut iov, &mut control, RecvFlags::DONTWAIT | RecvFlags::CMSG_CLOEXEC)
        {
            Ok(r) => r,
            Err(Errno::AGAIN) => return Ok(Received::Empty),
            Err(Errno::CONNRESET) => return Ok(Received::Closed),
            Err(e) => return Err(Error::io("recvmsg", e)),
        };
    let mut fds = Vec::new();
    for m in control.drain() {
        if let RecvAncillaryMessage::ScmRights(rights) = m {
            fds.extend(rights);
        }
    }
    if r.flags.contains(ReturnFlags::CTRUNC) {
        crate::shm::fd_reserve::met();
        return Ok(Received::Bad(Error::InvalidMessage(format!(
            "the message's descriptors were cut off ({} arrived): this process has reached its \
             descriptor limit (RLIMIT_NOFILE); raise it or hold fewer shared segments",
            fds.len()
        ))));
    }
    if r.flags.contains(ReturnFlags::TRUNC) {
        return Ok(Received::Bad(Error::invalid(format!("a record larger than {cap} bytes"))));
    }
    if r.bytes == 0 && fds.is_empty() {
        // The end of the stream, or a record of no bytes that a peer sent: only the first
        // shows as a hang-up.
        let mut pfd = [PollFd::from_borrowed_fd(fd, PollFlags::RDHUP)];
        let zero = rustix::event::Timespec { tv_sec: 0, tv_nsec: 0 };
        let _ = rustix::event::poll(&mut pfd, Some(&zero));
        if pfd[0].revents().intersects(PollFlags::RDHUP | PollFlags::HUP) {
            return Ok(Received::Closed);
        }
        return Ok(Received::Bad(Error::invalid("an empty record is not a message")));
    }
    Ok(Received::Record(Record { bytes: bytes[..r.bytes].to_vec(), fds }))
}

/// Waits for a record until the deadline. `alive` says whether a writer can still exist;
/// when it says no while nothing is waiting, the result is `Disconnected`.
pub(crate) fn recv(fd: BorrowedFd<'_>, deadline: Deadline, alive: &dyn Fn() -> bool) -> Result<Record> {
    recv_taken(fd, deadline, alive, None)?
}

/// [`recv`], telling apart a record that was taken off the socket but is no message (the
/// inner error) from a receive that took nothing.
///
/// `awake`, when the channel has a doorbell, is a word that every sender bumps after each
/// record it writes (see `control`): while the receive polls awake it watches the word
/// rather than asking the socket again and again, which costs a syscall each time and
/// contends with the sender for the socket's lock; and when the last sender ran on this very
/// CPU, it sleeps at once instead, so that the sender can run (two processes that share a CPU
/// would otherwise take turns only when the spin gives up). The bell only says when to look
/// and whether to stay awake: a peer that writes it causes a needless look or an early
/// sleep, nothing else. How long such a receive polls awake is its handle's [`Patience`].
pub(crate) fn recv_taken(
    fd: BorrowedFd<'_>,
    deadline: Deadline,
    alive: &dyn Fn() -> bool,
    awake: Option<Awake<'_>>,
) -> Result<Result<Record>> {
    let bell = awake.map(|a| a.bell);
    let mut spin_until = Instant::now() + SPIN;
    let mut yield_after = spin_until;
    // When the first look found nothing (the wait the patience learns from).
    let mut empty_since: Option<Instant> = None;
    let learn = |since: Option<Instant>| {
        if let (Some(a), Some(since)) = (awake, since) {
            a.patience.learn(since.elapsed());
        }
    };
    loop {
        // Read before looking: a record written after the look rings after this read.
        let rung = bell.map(Bell::rung);
        match try_recv(fd)? {
            Received::Record(r) => {
                learn(empty_since);
                return Ok(Ok(r));
            }
            Received::Bad(e) => return Ok(Err(e)),
            Received::Closed => return Err(Error::Disconnected),
            Received::Empty => {}
        }
        if empty_since.is_none() {
            // Nothing to receive yet: time for what the last receive left for later. The
            // wait, and the window, start after it: it is this process's work, not waiting.
            crate::arena::idle();
            let since = Instant::now();
            empty_since = Some(since);
            if bell.is_some_and(Bell::sender_shares_this_cpu) {
                spin_until = since;
            } else if let Some(a) = awake {
                spin_until = since + a.patience.window();
                yield_after = since + SPIN;
            }
            // A record that came meanwhile has rung the bell (read before the look), or
            // makes the poll below return at once: no second look needed here.
        }
        let now = Instant::now();
        if now < spin_until && !deadline.passed(now) {
            if let (Some(b), Some(rung)) = (bell, rung) {
                let _ = watch(b, rung, spin_until, yield_after, deadline);
            } else {
                std::hint::spin_loop();
            }
            continue;
        }
        let Some(slice) = deadline.slice() else { return Err(Error::Timeout) };
        if !wait(fd, PollFlags::IN, slice)? && !alive() {
            // A record may have arrived just before the last writer went away.
            return match try_recv(fd)? {
                Received::Record(r) => {
                    learn(empty_since);
                    Ok(Ok(r))
                }
                Received::Bad(e) => Ok(Err(e)),
                _ => Err(Error::Disconnected),
            };
        }
    }
}
