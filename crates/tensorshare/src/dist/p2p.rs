//! `send` and `recv`: to a rank of this node as a tensorshare message on the pair's socket
//! (tensors as handles), to a rank of another node as bytes through MPI (tensors by value).

use serde::de::DeserializeOwned;
use serde::Serialize;

use super::links::Channel;
use super::net;
use super::state::State;
use crate::{wire, Error, Result};

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
        Some(local) => st.links()?.send(&st.topo, local, Channel::P2p, value, during),
        None => net::send_bytes(&st.world, dst, &wire::to_value_bytes(value)?),
    }
}

/// `dist::recv`: see there.
pub(super) fn recv<T: DeserializeOwned>(st: &State, src: usize, during: &str) -> Result<T> {
    peer(st, src, "source")?;
    match st.topo.local_index(src) {
        Some(local) => st.links()?.recv(&st.topo, local, Channel::P2p, during),
        None => wire::from_value_bytes(&net::recv_bytes(&st.world, src)?),
    }
}
