//! The node's links: two sockets between every pair of ranks of a node (one for `send` and
//! `recv`, one for collectives, so that a message waiting for a `recv` never meets a
//! collective), carrying tensorshare messages: tensors travel as arena handles. `send`
//! passes a queue for the pair on its socket once, and its values through the queue after
//! (see `p2p`).
//!
//! A rank's sockets close when its process ends, however it ends: a peer that waits on it
//! (in a receive, or at the board's barrier, which polls the sockets) gets an error that
//! names it. A rank that leaves the process group after a failure closes its sockets on
//! purpose, for the same effect. A process the rank forked may hold the sockets on, so each
//! peer is also watched through a pidfd of its own process, which the kernel makes readable
//! when that process ends, whatever still holds its sockets.

use std::cell::RefCell;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;

use rustix::event::{PollFd, PollFlags};
use serde::de::DeserializeOwned;
use serde::Serialize;

use super::board::Board;
use super::topology::Topology;
use super::DistError;
use crate::channel::socket::{self, Deadline};
use crate::channel::AnyQueue;
use crate::{wire, Error, Result};

/// Which of a pair's two sockets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Channel {
    /// `send` and `recv`.
    P2p,
    /// Collectives.
    Coll,
}

/// The sockets to one other rank of the node.
pub(super) struct Peer {
    /// Its rank.
    pub(super) rank: usize,
    pub(super) p2p: Arc<OwnedFd>,
    pub(super) coll: Arc<OwnedFd>,
    /// A pidfd of its process, where the kernel gives one (else its sockets alone tell).
    pub(super) pidfd: Option<OwnedFd>,
    /// How its `send`s reach this rank (see `p2p`).
    pub(super) inbox: RefCell<Way>,
    /// How this rank's `send`s reach it (see `p2p`).
    pub(super) route: RefCell<Way>,
}

/// How one rank's `send`s reach another of the node (see `p2p`).
#[derive(Default)]
pub(super) enum Way {
    /// Nothing sent yet (the sender's first message on the pair's socket says which way).
    #[default]
    Unset,
    /// Through a queue the sender made for the pair and sent on the pair's `send` socket.
    Queue(AnyQueue),
    /// Through the socket itself (the sender could make no queue).
    Socket,
    /// Nowhere: the receiver could not receive the sender's first message, so it cannot
    /// know where the values after it go. Every `recv` from the sender fails with this.
    Lost(String),
}

impl Peer {
    /// Whether its process has ended (its pidfd is readable) or closed its `send` socket
    /// (it ended, or left the process group; a fork that tensorshare started does not keep
    /// the socket open, as a plain `fork` would).
    pub(super) fn gone(&self) -> bool {
        let mut fds = [PollFd::new(self.p2p.as_ref(), PollFlags::RDHUP)];
        let zero = rustix::event::Timespec { tv_sec: 0, tv_nsec: 0 };
        let hung_up = matches!(rustix::event::poll(&mut fds, Some(&zero)), Ok(n) if n > 0)
            && fds[0].revents().intersects(PollFlags::RDHUP | PollFlags::HUP | PollFlags::ERR);
        hung_up || self.ended()
    }

    /// Whether its process has ended (its pidfd is readable).
    pub(super) fn ended(&self) -> bool {
        let Some(fd) = &self.pidfd else { return false };
        let mut fds = [PollFd::new(fd, PollFlags::IN)];
        let zero = rustix::event::Timespec { tv_sec: 0, tv_nsec: 0 };
        matches!(rustix::event::poll(&mut fds, Some(&zero)), Ok(n) if n > 0)
    }
}

/// What this rank shares with the other ranks of its node.
pub(super) struct NodeLinks {
    /// This rank's local rank.
    pub(super) me: usize,
    /// By local rank; `None` for this rank.
    pub(super) peers: Vec<Option<Peer>>,
    pub(super) board: Board,
    /// How long this rank's receives poll awake, per channel (see `socket::Patience`).
    pub(super) patience: [socket::Patience; 2],
}

impl NodeLinks {
    pub(super) fn peer(&self, local: usize) -> Result<&Peer> {
        self.peers.get(local).and_then(Option::as_ref).ok_or_else(|| {
            Error::invalid_argument("local rank", format!("{local} is this rank, or not a rank of this node"))
        })
    }

    fn fd(&self, local: usize, ch: Channel) -> Result<(&Arc<OwnedFd>, usize)> {
        let p = self.peer(local)?;
        Ok((if ch == Channel::P2p { &p.p2p } else { &p.coll }, p.rank))
    }

    /// Sends `value` to local rank `local` on `ch`; tensors go as handles (shared in place).
    pub(super) fn send<T: Serialize + ?Sized>(
        &self,
        topo: &Topology,
        local: usize,
        ch: Channel,
        value: &T,
        during: &str,
    ) -> Result<()> {
        let (fd, rank) = self.fd(local, ch)?;
        let peer = self.peer(local)?;
        let msg = wire::encode(value)?;
        // A closed peer shows as EPIPE; one whose sockets a fork holds, through its pidfd.
        socket::send(fd.as_fd(), msg, Deadline::after(None), &|| !self.left(local, peer))
            .map_err(|e| gone(e, topo, self.cause(topo, rank), during))?;
        if let Some(bell) = self.board.bell(local, ch as usize) {
            bell.ring();
        }
        Ok(())
    }

    /// Receives a value from local rank `local` on `ch`, waiting as long as it takes (or
    /// until the peer is gone).
    pub(super) fn recv<T: DeserializeOwned>(
        &self,
        topo: &Topology,
        local: usize,
        ch: Channel,
        during: &str,
    ) -> Result<T> {
        let (fd, rank) = self.fd(local, ch)?;
        let peer = self.peer(local)?;
        let awake = (self.board.bell(self.me, ch as usize))
            .map(|bell| socket::Awake { bell, patience: &self.patience[ch as usize] });
        let record =
            socket::recv_taken(fd.as_fd(), Deadline::after(None), &|| !self.left(local, peer), awake)
                .map_err(|e| gone(e, topo, self.cause(topo, rank), during))??;
        record.decode_received()
    }

    /// An error naming the first peer whose collective socket shows that it is gone.
    pub(super) fn check_alive(&self, topo: &Topology, during: &str) -> Result<()> {
        let present: Vec<&Peer> = self.peers.iter().flatten().collect();
        if present.is_empty() {
            return Ok(());
        }
        let mut fds: Vec<PollFd<'_>> =
            present.iter().map(|p| PollFd::new(p.coll.as_ref(), PollFlags::RDHUP)).collect();
        let zero = rustix::event::Timespec { tv_sec: 0, tv_nsec: 0 };
        match rustix::event::poll(&mut fds, Some(&zero)) {
            Ok(_) | Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(Error::io("poll of the node's sockets", e)),
        }
        for (fd, p) in fds.iter().zip(&present) {
            let local = topo.local_index(p.rank);
            let departed = local.is_some_and(|l| self.board.departed_for(l).is_some());
            if fd.revents().intersects(PollFlags::RDHUP | PollFlags::HUP | PollFlags::ERR)
                || departed
                || p.ended()
            {
                return Err(topo.gone(self.cause(topo, p.rank), during).into());
            }
        }
        Ok(())
    }

    /// The rank to blame for `rank`'s absence: the one whose loss made it leave, if it left
    /// on purpose, so that every survivor names the rank that died.
    pub(super) fn cause(&self, topo: &Topology, rank: usize) -> usize {
        let local = topo.local_index(rank);
        match local.and_then(|l| self.board.departed_for(l)) {
            Some(c) => topo.local_ranks().get(c).copied().unwrap_or(rank),
            None => rank,
        }
    }
}

impl NodeLinks {
    /// Whether local rank `local` is gone: its process ended, it left the process group,
    /// or it closed its sockets.
    pub(super) fn gone_now(&self, local: usize) -> bool {
        self.board.departed_for(local).is_some() || self.peer(local).is_ok_and(Peer::gone)
    }

    /// Whether local rank `local` (`peer`) ended or left the process group (a fork of it may
    /// still hold its sockets).
    fn left(&self, local: usize, peer: &Peer) -> bool {
        self.board.departed_for(local).is_some() || peer.ended()
    }

    /// Drops the values this rank sent that nobody has received yet and will not: the
    /// process group is broken.
    pub(super) fn abandon_routes(&self) {
        for p in self.peers.iter().flatten() {
            if let Way::Queue(q) = p.route.take() {
                q.abandon();
            }
        }
    }
}

impl Drop for NodeLinks {
    /// This rank leaves the group (on the board, unless it left already, saying why), so
    /// that a rank waiting for it stops waiting; then every pair's queue in is let go of,
    /// then every pair's queue out: a rank's values still on their way are written while
    /// their receiver is there to take them (not while the thread panics: then they go). In
    /// that order, so that two ranks that each wait for the other to let go of a queue
    /// cannot wait forever, and a rank that waits for this one to take part in something
    /// fails instead of keeping this one waiting.
    fn drop(&mut self) {
        if self.board.departed_for(self.me).is_none() {
            self.board.depart(self.me, self.me);
        }
        for p in self.peers.iter().flatten() {
            drop(p.inbox.take());
        }
        let panicking = std::thread::panicking();
        for (local, p) in self.peers.iter().enumerate() {
            let Some(p) = p else { continue };
            match p.route.take() {
                Way::Queue(q) if panicking => q.abandon(),
                Way::Queue(q) => q.close_while(&|| self.board.departed_for(local).is_none() && !p.gone()),
                _ => {}
            }
        }
    }
}

/// A hang-up from `rank` as the error that names it; other errors as they are.
pub(super) fn gone(e: Error, topo: &Topology, rank: usize, during: &str) -> Error {
    match e {
        Error::Disconnected => Error::Dist(topo.gone(rank, during)),
        e => e,
    }
}

/// Whether `e` means that a rank of the node is gone (the process group is then broken).
pub(super) fn is_gone(e: &Error) -> bool {
    matches!(e, Error::Dist(DistError::RankGone { .. }))
}
