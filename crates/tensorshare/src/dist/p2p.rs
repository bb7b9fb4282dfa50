//! `send` and `recv`: to a rank of this node as a tensorshare message (tensors as handles),
//! to a rank of another node as bytes through MPI (tensors by value).
//!
//! Between two ranks of a node, a rank's first `send` to the other makes a queue for the
//! pair and sends it, as the first message on the pair's `send` socket; that `send` and
//! every later one put their values into the queue, whose lane carries a small message with
//! no system call while the receiver is awake (see `channel::lane`). A rank that cannot make
//! a queue (shared memory full) says so instead, and sends its values on the socket. The
//! receiver reads that first message, then the values from wherever it says. A first
//! message the receiver cannot receive (at its descriptor limit, say) leaves it unable to
//! know where the values are: the `recv` fails, saying why, and breaks the process group
//! (so that the sender, whose values nobody can take, hears of it too).
//!
//! The queue holds at most `IN_FLIGHT` values: a `send` waits while that many wait
//! unreceived, as one waited for room in the socket. Whoever waits, in a `send` or a
//! `recv`, looks every `WATCH` whether the other rank is gone: its process ended (its
//! pidfd, which a fork of it holding the queue does not hide), or it closed its sockets or
//! left the process group. The queue alone would not tell: a fork of a rank holds it on.

use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use super::links::{self, Channel, NodeLinks, Way};
use super::net;
use super::state::State;
use super::topology::Topology;
use super::DistError;
use crate::channel::AnyQueue;
use crate::{wire, Error, Result};

/// How often a rank waiting for another in a pair's queue looks whether it is gone.
const WATCH: Duration = Duration::from_millis(50);
/// Most values a pair's queue holds unreceived.
const IN_FLIGHT: u32 = 64;

/// The first message on a pair's `send` socket: where the values after it go.
#[derive(Serialize)]
enum HelloOut<'a> {
    Queue(&'a AnyQueue),
    Socket,
}

/// `HelloOut` as received (the same variants, in the same order).
#[derive(Deserialize)]
enum HelloIn {
    Queue(AnyQueue),
    Socket,
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
    if matches!(*route, Way::Unset) {
        *route = match AnyQueue::with_capacity(IN_FLIGHT) {
            Ok(q) => {
                links.send(topo, local, Channel::P2p, &HelloOut::Queue(&q), during)?;
                Way::Queue(q)
            }
            Err(_) => {
                links.send(topo, local, Channel::P2p, &HelloOut::Socket, during)?;
                Way::Socket
            }
        };
    }
    let Way::Queue(q) = &*route else {
        return links.send(topo, local, Channel::P2p, value, during);
    };
    loop {
        match q.put_timeout(value, WATCH) {
            Err(Error::Timeout) if !links.gone_now(local) => continue,
            Err(Error::Timeout | Error::Disconnected) => {
                return Err(links::gone(Error::Disconnected, topo, links.cause(topo, peer.rank), during))
            }
            r => return r,
        }
    }
}

/// Receives a value from local rank `local`: from where the first message from it says.
fn recv_local<T: DeserializeOwned>(
    links: &NodeLinks,
    topo: &Topology,
    local: usize,
    during: &str,
) -> Result<T> {
    let peer = links.peer(local)?;
    let mut inbox = peer.inbox.borrow_mut();
    if matches!(*inbox, Way::Unset) {
        *inbox = match links.recv::<HelloIn>(topo, local, Channel::P2p, during) {
            Ok(HelloIn::Queue(q)) if q.only_handle() => Way::Queue(q),
            Ok(HelloIn::Queue(_)) => Way::Lost(format!(
                "rank {}'s first message to this rank names a queue this rank holds already, not one \
                 made for the pair: nothing it sends can be received",
                peer.rank
            )),
            Ok(HelloIn::Socket) => Way::Socket,
            Err(e) if links::is_gone(&e) => return Err(e),
            Err(e) => Way::Lost(format!(
                "rank {}'s first message to this rank, which says where its values go, could not be \
                 received ({e}): nothing it sends can be received",
                peer.rank
            )),
        };
    }
    let q = match &*inbox {
        Way::Queue(q) => q,
        Way::Lost(why) => return Err(DistError::Broken(why.clone()).into()),
        _ => return links.recv::<T>(topo, local, Channel::P2p, during),
    };
    loop {
        match q.get_timeout::<T>(WATCH) {
            Err(Error::Timeout) if !links.gone_now(local) => continue,
            // A value may have come just before the sender went.
            Err(Error::Timeout | Error::Disconnected) => match q.get_timeout::<T>(Duration::ZERO) {
                Err(Error::Timeout | Error::Disconnected) => {
                    return Err(links::gone(Error::Disconnected, topo, links.cause(topo, peer.rank), during))
                }
                r => return r,
            },
            r => return r,
        }
    }
}
