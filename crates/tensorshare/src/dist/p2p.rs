//! `send` and `recv`: to a rank of this node as a tensorshare message (tensors as handles),
//! to a rank of another node as bytes through MPI (tensors by value).
//!
//! Between two ranks of a node, a rank's first `send` to the other makes a queue for the
//! pair and sends it on the pair's `send` socket; that `send` and every later one put
//! their values into the queue, whose lane carries a small message with no system call
//! while the receiver is awake (see `channel::lane`). The receiver reads the socket until
//! the queue comes, and the queue from then on, so values arrive in the order sent. A rank
//! that cannot make a queue (shared memory full) sends on the socket instead.
//!
//! A receiver waiting in the queue learns that the sender is gone as it does on the
//! socket: the queue has no other holder left once the sender's process has ended, or
//! (where a fork of it holds the queue on) the sender's pidfd says so, looked at every
//! `WATCH`.

use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use super::links::{self, Channel, NodeLinks, Route};
use super::net;
use super::state::State;
use super::topology::Topology;
use crate::channel::AnyQueue;
use crate::{wire, Error, Result};

/// How often a receiver waiting in a pair's queue looks whether the sender has ended.
const WATCH: Duration = Duration::from_millis(50);

/// What a pair's `send` socket carries.
#[derive(Serialize)]
enum Out<'a, T: ?Sized> {
    Value(&'a T),
    /// The queue the values after it come through.
    Queue(&'a AnyQueue),
}

/// What a pair's `send` socket carries, as received (the variants of `Out`, in order).
#[derive(Deserialize)]
enum In<T> {
    Value(T),
    Queue(AnyQueue),
}

/// The other rank `rank` names, checked.
fn peer(st: &State, rank: usize, what: &'static str) -> Result<()> {
    let topo = &st.topo;
    if rank >= topo.world_size() {
        return Err(Error::invalid_argument(
            what,
            format!("rank {rank} in a job of {} ranks", topo.world_size()),
        ));
    }
    if rank == topo.rank() {
        return Err(Error::invalid_argument(what, format!("rank {rank} is this rank")));
    }
    Ok(())
}

/// `dist::send`: see there.
pub(super) fn send<T: Serialize + ?Sized>(st: &State, value: &T, dst: usize, during: &str) -> Result<()> {
    peer(st, dst, "destination")?;
    match st.topo.local_index(dst) {
        Some(local) => send_local(st.links()?, &st.topo, local, value, during),
        None => net::send_bytes(&st.world, dst, &wire::to_value_bytes(value)?),
    }
}

/// `dist::recv`: see there.
pub(super) fn recv<T: DeserializeOwned>(st: &State, src: usize, during: &str) -> Result<T> {
    peer(st, src, "source")?;
    match st.topo.local_index(src) {
        Some(local) => recv_local(st.links()?, &st.topo, local, during),
        None => wire::from_value_bytes(&net::recv_bytes(&st.world, src)?),
    }
}

/// Sends `value` to local rank `local`: through the pair's queue, made at the first send.
fn send_local<T: Serialize + ?Sized>(
    links: &NodeLinks,
    topo: &Topology,
    local: usize,
    value: &T,
    during: &str,
) -> Result<()> {
    let peer = links.peer(local)?;
    let mut route = peer.route.borrow_mut();
    if matches!(*route, Route::Unset) {
        *route = match AnyQueue::new() {
            Ok(q) => {
                links.send(topo, local, Channel::P2p, &Out::<()>::Queue(&q), during)?;
                Route::Queue(q)
            }
            // The socket carries values as well, only with a system call each.
            Err(_) => Route::Socket,
        };
    }
    match &*route {
        Route::Queue(q) => q.put(value),
        _ => links.send(topo, local, Channel::P2p, &Out::Value(value), during),
    }
}

/// Receives a value from local rank `local`: from the pair's socket until the sender's
/// queue comes, from the queue after.
fn recv_local<T: DeserializeOwned>(
    links: &NodeLinks,
    topo: &Topology,
    local: usize,
    during: &str,
) -> Result<T> {
    let peer = links.peer(local)?;
    let mut inbox = peer.inbox.borrow_mut();
    let q = match &mut *inbox {
        Some(q) => q,
        slot @ None => match links.recv::<In<T>>(topo, local, Channel::P2p, during)? {
            In::Value(v) => return Ok(v),
            In::Queue(q) => slot.insert(q),
        },
    };
    loop {
        match q.get_timeout::<T>(WATCH) {
            Err(Error::Timeout) if !peer.ended() => continue,
            Err(Error::Timeout | Error::Disconnected) => {
                return Err(links::gone(Error::Disconnected, topo, links.cause(topo, peer.rank), during))
            }
            r => return r,
        }
    }
}
