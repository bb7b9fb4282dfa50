//! How a lane message's receiver reaches the arenas it names and holds its slots.
//!
//! A message from a queue's socket carries its sender's send description, and its receiver
//! borrows the holds of that description rather than locking the slots itself (see
//! `arena::borrow`). A lane message carries no descriptor, but its description is parked in
//! the queue's directory under a tag the message names (see `Arena::send_hold`), so its
//! receiver can take a descriptor of it from there and borrow it the same way. A sender's
//! description carries up to `arena::SEND_BATCH` messages, so the receiver keeps what it
//! found for the messages that follow: one look at the directory instead of one lock per
//! message. It keeps at most `PER_ARENA` descriptions of an arena, the latest messages
//! named (a sender has one at a time, and retires it for the next), and `MAX_BORROWED` in
//! all, and lets one go once a lane message two windows later comes without naming it,
//! when a receive of any queue of the process has waited `QUIET`, at `trim_arenas` and when
//! the queue is dropped. So it holds a sender's slots about as long as the directory does
//! while messages flow, and a little longer than a socket message's receiver, which holds
//! its description until its next receive or wait, when they stop.
//!
//! A tag is only a name. A peer can park any description of an arena under any tag: the
//! one found is checked to be the arena's, and at worst holds other slots of it than the
//! message names, which is what a peer could cause by writing the arena (see the README's
//! threat model).

use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;
use std::time::Duration;

use super::FETCH_PATIENCE;
use crate::channel::lane::directory;
use crate::channel::queue_core::Core;
use crate::shm::FileId;
use crate::wire::LaneArenas;
use crate::{Error, Result};

/// Most descriptions a process keeps per queue: a peer naming a new tag in every message
/// makes it look each up once, and keep no more than this.
const MAX_BORROWED: usize = 64;
/// Most descriptions of one arena it keeps: its sender's current one and the one before (or
/// those of two processes sending its slots under descriptions of their own).
const PER_ARENA: usize = 2;

/// A tag looked up in the directory: the description found under it, or None when there
/// was none (not looked up again while kept).
pub(super) struct Borrowed {
    id: FileId,
    tag: u64,
    desc: Option<Arc<OwnedFd>>,
    /// The latest window of a message that named it.
    window: u64,
}

/// A queue taking the lane message at a position of `window`.
pub(super) struct Taking<'a> {
    pub(super) core: &'a Core,
    pub(super) window: u64,
}

impl LaneArenas for Taking<'_> {
    fn known(&self, id: FileId) -> bool {
        self.core.lane.lock().known.contains(&id)
    }

    fn fetch(&self, id: FileId) -> Result<OwnedFd> {
        let core = self.core;
        let is_it = |e: &directory::Entry| {
            e.id == id
                && (e.cut || e.fd.as_ref().is_some_and(|f| crate::shm::file_id(f.as_fd()).ok() == Some(id)))
        };
        let find = || {
            core.control.with_directory(FETCH_PATIENCE, || directory::find(core.tx.as_fd(), is_it)).map_err(
                |e| match e {
                    Error::Timeout => Error::InvalidMessage(
                        "the queue's lane directory stayed locked by another process: the arena a \
                         lane message names cannot be looked up"
                            .into(),
                    ),
                    e => e,
                },
            )?
        };
        let mut found = find()?;
        // Cut: its descriptor found no room here. Again with a kept one given up for it.
        while found.as_ref().is_some_and(|e| e.cut) && crate::shm::fd_reserve::give_one() {
            found = find()?;
        }
        if found.as_ref().is_some_and(|e| e.cut) {
            return Err(Error::InvalidMessage(
                "the descriptor of an arena the message names could not be received: this process \
                 has reached its descriptor limit (RLIMIT_NOFILE); raise it or hold fewer shared \
                 segments"
                    .into(),
            ));
        }
        let fd = found.and_then(|e| e.fd).ok_or_else(|| {
            Error::invalid("a lane message names an arena its queue's directory does not hold")
        })?;
        core.lane.lock().known.insert(id);
        Ok(fd)
    }

    fn via(&self, id: FileId, tag: u64) -> Option<Arc<OwnedFd>> {
        let window = self.window;
        if let Some(b) = self.core.lane.lock().borrowed.iter_mut().find(|b| b.id == id && b.tag == tag) {
            b.window = b.window.max(window);
            return b.desc.clone();
        }
        // Looked up without the lane's lock, which producers take before the directory's, and
        // only if the directory's lock is free now: where another process holds it, one lock
        // of the slots costs less than waiting (and the next message looks again).
        let core = self.core;
        let is_it = |e: &directory::Entry| {
            e.id == id
                && e.tag == tag
                && e.fd.as_ref().is_some_and(|f| crate::shm::file_id(f.as_fd()).ok() == Some(id))
        };
        let found = core.control.with_directory(Duration::ZERO, || directory::find(core.tx.as_fd(), is_it));
        // Not kept when the look failed (it may succeed next time); kept when it found nothing.
        let Ok(Ok(found)) = found else { return None };
        let desc = found.and_then(|e| e.fd).map(Arc::new);
        let mut l = core.lane.lock();
        // The arena's oldest description goes (its sender has retired it), and the oldest of
        // all past the bound.
        if l.borrowed.iter().filter(|b| b.id == id).count() >= PER_ARENA {
            let oldest = l.borrowed.iter().position(|b| b.id == id).expect("counted above");
            l.borrowed.remove(oldest);
        }
        if l.borrowed.len() >= MAX_BORROWED {
            l.borrowed.remove(0);
        }
        l.borrowed.push(Borrowed { id, tag, desc: desc.clone(), window });
        desc
    }
}

/// Before a lane message of `window` is taken: the descriptions no lane message has named
/// for two windows go (a window of a peer's may be anywhere: the arithmetic saturates).
pub(super) fn forget_old(borrowed: &mut Vec<Borrowed>, window: u64) {
    borrowed.retain(|b| b.window.saturating_add(2) > window);
}
