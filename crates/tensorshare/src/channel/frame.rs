//! How one message travels as one socket record.
//!
//! A record is `[u8 flags][u64 spilled length, if SPILLED][u32 table size, if SIDE]
//! [the message's bytes, unless SPILLED]`. Its descriptors are the message's table, or
//! only a side socket when the table is larger than one record can carry (SIDE), followed
//! by the spill memfd (SPILLED). A message larger than [`MAX_INLINE`] moves its bytes into a
//! sealed memfd, which the receiver reads in place; a side socket holds the whole table,
//! written before the record is sent, and its writing end is closed so that its end shows.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use rustix::event::PollFlags;
use serde::de::DeserializeOwned;

use super::socket::{self, Received, Record};
use crate::shm::sealed::{self, SealedBytes};
use crate::wire::{self, Encoded};
use crate::{Error, Result};

/// Largest record sent as is; a larger message travels in a sealed memfd.
pub(crate) const MAX_INLINE: usize = 64 * 1024;
/// Most descriptors one record may carry (the kernel's SCM_MAX_FD).
pub(crate) const MAX_FDS: usize = 253;
/// Most descriptors a message's table may hold (on a side socket).
const MAX_TABLE: u32 = 1 << 16;

const SPILLED: u8 = 1;
const SIDE: u8 = 2;
/// A record that carries no message, only readiness: written into a queue's socket after a
/// lane message when someone waits on the socket (see `queue_lane`). Receivers drop it.
const NUDGE: u8 = 4;

/// Writes a nudge into `fd`, without waiting (a full socket is readable already). Returns
/// whether it was written.
pub(crate) fn nudge(fd: BorrowedFd<'_>) -> bool {
    socket::send_record(fd, [&[NUDGE], &[]], &[]).is_ok()
}

/// Whether `record` is a nudge.
pub(crate) fn is_nudge(record: &Record) -> bool {
    record.bytes == [NUDGE] && record.fds.is_empty()
}

pub use crate::shm::sealed::MAX_MESSAGE_ENV;

fn max_message_bytes() -> u64 {
    static MAX: crate::util::Lazy<u64> = crate::util::Lazy::new();
    *MAX.get_or_make(|| std::env::var(MAX_MESSAGE_ENV).ok().and_then(|v| v.parse().ok()).unwrap_or(1 << 30))
}

/// A message framed for the socket.
pub(crate) struct Outgoing {
    head: Vec<u8>,
    msg: Encoded,
    /// The side socket or the spill memfd, when there are any.
    extra: Vec<OwnedFd>,
    side: bool,
}

impl Outgoing {
    pub(crate) fn new(msg: Encoded) -> Result<Outgoing> {
        let msg = msg.framed()?;
        let mut out = Outgoing { head: vec![0], msg, extra: Vec::new(), side: false };
        // One place stays free for a spill memfd.
        if out.msg.fds.len() >= MAX_FDS {
            let n = u32::try_from(out.msg.fds.len())
                .ok()
                .filter(|&n| n <= MAX_TABLE)
                .ok_or_else(|| Error::Serialize(format!("a message of over {MAX_TABLE} descriptors")))?;
            out.extra.push(write_side(&out.msg.borrowed_fds())?);
            out.head[0] |= SIDE;
            out.head.extend_from_slice(&n.to_le_bytes());
            out.side = true;
        }
        if out.msg.bytes.len() + out.head.len() > MAX_INLINE {
            out.spill()?;
        }
        Ok(out)
    }

    /// Moves the message's bytes into a sealed memfd that travels as the last descriptor.
    pub(crate) fn spill(&mut self) -> Result<()> {
        if self.head[0] & SPILLED != 0 {
            return Ok(());
        }
        self.extra.push(sealed::write(&self.msg.bytes)?);
        let len = self.msg.bytes.len() as u64;
        self.msg.bytes = Vec::new();
        self.head[0] |= SPILLED;
        self.head.splice(1..1, len.to_le_bytes());
        Ok(())
    }

    pub(crate) fn is_spilled(&self) -> bool {
        self.head[0] & SPILLED != 0
    }

    pub(crate) fn parts(&self) -> [&[u8]; 2] {
        [&self.head, &self.msg.bytes]
    }

    pub(crate) fn fds(&self) -> Vec<BorrowedFd<'_>> {
        let mut fds = if self.side { Vec::new() } else { self.msg.borrowed_fds() };
        fds.extend(self.extra.iter().map(AsFd::as_fd));
        fds
    }
}

/// Writes a descriptor table too large for one record onto a new socket, in records of at
/// most MAX_FDS, and returns the reading end.
fn write_side(fds: &[BorrowedFd<'_>]) -> Result<OwnedFd> {
    let (w, r) = socket::pair()?;
    for chunk in fds.chunks(MAX_FDS) {
        socket::send_record(w.as_fd(), [&[SIDE], &[]], chunk)
            .map_err(|e| Error::io(format!("passing the {} descriptors of one message", fds.len()), e))?;
    }
    Ok(r) // `w` closes here: the reader sees where the table ends
}

/// Reads a descriptor table of `n` entries from a side socket: only from a socket whose
/// writer has finished (so never from a live channel's socket a peer passed instead).
fn read_side(sock: OwnedFd, n: u32) -> Result<Vec<OwnedFd>> {
    if n > MAX_TABLE {
        return Err(Error::invalid(format!("a message claims a table of {n} descriptors")));
    }
    let st = rustix::fs::fstat(&sock).map_err(|e| Error::io("fstat of a side socket", e))?;
    if rustix::fs::FileType::from_raw_mode(st.st_mode) != rustix::fs::FileType::Socket {
        return Err(Error::invalid("a message's side descriptor is not a socket"));
    }
    let mut pfd = [rustix::event::PollFd::new(&sock, PollFlags::RDHUP)];
    let zero = rustix::event::Timespec { tv_sec: 0, tv_nsec: 0 };
    let _ = rustix::event::poll(&mut pfd, Some(&zero));
    if !pfd[0].revents().intersects(PollFlags::RDHUP | PollFlags::HUP) {
        return Err(Error::invalid("a message's side socket is still open for writing: not a side table"));
    }
    let mut out = Vec::with_capacity(n as usize);
    loop {
        match socket::try_recv(sock.as_fd())? {
            Received::Record(r) => out.extend(r.fds),
            Received::Bad(e) => return Err(e),
            Received::Closed | Received::Empty => break,
        }
        if out.len() > n as usize {
            break;
        }
    }
    if out.len() != n as usize {
        return Err(Error::invalid(format!(
            "the message names {n} descriptors, its side socket held {}",
            out.len()
        )));
    }
    Ok(out)
}

/// A received record back into a value. `borrow`: the receiver may hold what the message
/// brings through the message's descriptors for a while (see `wire::decode`); queues and
/// pipes do, values that arrive any other way do not.
pub(crate) fn decode<T: DeserializeOwned>(record: Record, borrow: bool) -> Result<T> {
    let Record { bytes, mut fds } = record;
    let (&flags, mut rest) =
        bytes.split_first().ok_or_else(|| Error::invalid("an empty record is not a message"))?;
    if flags & !(SPILLED | SIDE) != 0 {
        return Err(Error::invalid(format!("a record with unknown flags {flags:#x}")));
    }
    let mut take = |n: usize| -> Result<&[u8]> {
        let (a, b) =
            rest.split_at_checked(n).ok_or_else(|| Error::invalid("a record's frame is cut short"))?;
        rest = b;
        Ok(a)
    };
    let spilled = match flags & SPILLED {
        0 => None,
        _ => Some(u64::from_le_bytes(take(8)?.try_into().map_err(|_| Error::invalid("a record's frame"))?)),
    };
    let side = match flags & SIDE {
        0 => None,
        _ => Some(u32::from_le_bytes(take(4)?.try_into().map_err(|_| Error::invalid("a record's frame"))?)),
    };
    let spill = match spilled {
        None => None,
        Some(len) => {
            let fd = fds.pop().ok_or_else(|| Error::invalid("a spilled message without its memfd"))?;
            if !rest.is_empty() {
                return Err(Error::invalid("a spilled message with bytes in its record"));
            }
            Some(SealedBytes::open(fd, len, max_message_bytes())?)
        }
    };
    if let Some(n) = side {
        let mut it = fds.into_iter();
        let (Some(sock), None) = (it.next(), it.next()) else {
            return Err(Error::invalid("a message with a side socket carries exactly that descriptor"));
        };
        fds = read_side(sock, n)?;
    }
    let message = match &spill {
        Some(s) => s.as_slice(),
        None => rest,
    };
    wire::decode(message, fds, borrow)
}
