//! `broadcast` and `all_gather`: tensors handed as handles inside a node, their elements
//! sent by the leaders between nodes, and copied into each rank's own tensors.

use super::collective::{self, agree, exchange, hand_out, receive, zeroed};
use super::net;
use super::state::State;
use super::verdict::Kind;
use crate::{Error, Result, Tensor};

/// A private tensor of `like`'s dtype and `shape` holding `bytes`.
fn from_bytes(like: &Tensor, bytes: &[u8]) -> Result<Tensor> {
    let mut t = Tensor::try_zeros(like.shape(), like.dtype())?;
    t.store_range(0, bytes)?;
    Ok(t)
}

/// `dist::broadcast`: see there.
pub(super) fn broadcast(st: &mut State, tensor: &mut Tensor, src: usize, during: &str) -> Result<()> {
    let world = st.topo.world_size();
    let mut refusal = collective::refusal(tensor);
    if src >= world {
        refusal = Some(format!("it names rank {src} as the source, in a job of {world} ranks"));
    }
    let mut work = None;
    if refusal.is_none() && src == st.topo.rank() {
        match collective::shared(tensor) {
            Ok(w) => work = Some(w),
            Err(e) => refusal = Some(e.to_string()),
        }
    }
    agree(st, Kind::Broadcast(src), Some(tensor), refusal.as_deref(), during)?;
    if tensor.numel() == 0 || world == 1 {
        return Ok(());
    }
    let (home, here) = (st.topo.node_of(src).unwrap_or(0), st.topo.node());
    let leader = st.topo.local_rank() == 0;
    // The source's tensor (on its node) or the node's copy of it (elsewhere).
    let source = if here == home {
        let t = match work {
            Some(w) => {
                hand_out(st, &w, during)?;
                w
            }
            None => {
                let from = st.topo.local_index(src).unwrap_or(0);
                let t = receive(st, from, tensor, during)?;
                t.copy_into(tensor)?;
                t
            }
        };
        if let Some(leaders) = &st.leaders {
            net::broadcast_bytes(leaders, home, &mut t.to_bytes()?)?;
        }
        t
    } else if leader {
        let mut bytes = zeroed(tensor.numel() * tensor.dtype().size())?;
        let leaders =
            st.leaders.as_ref().ok_or_else(|| Error::invalid("a leader without its communicator"))?;
        net::broadcast_bytes(leaders, home, &mut bytes)?;
        let copy = collective::shared(&from_bytes(tensor, &bytes)?)?;
        hand_out(st, &copy, during)?;
        copy.copy_into(tensor)?;
        copy
    } else {
        let t = receive(st, 0, tensor, during)?;
        t.copy_into(tensor)?;
        t
    };
    // Nobody writes the tensors handed out before every rank has its copy.
    st.barrier(during)?;
    drop(source);
    Ok(())
}

/// `dist::all_gather`: see there.
pub(super) fn all_gather(st: &mut State, tensor: &Tensor, during: &str) -> Result<Vec<Tensor>> {
    let mut refusal = collective::refusal(tensor);
    let mut work = None;
    if refusal.is_none() {
        match collective::shared(tensor) {
            Ok(w) => work = Some(w),
            Err(e) => refusal = Some(e.to_string()),
        }
    }
    agree(st, Kind::AllGather, Some(tensor), refusal.as_deref(), during)?;
    let Some(work) = work else { return Err(Error::invalid("all_gather without a tensor")) };
    let topo = st.topo.clone();
    let local = exchange(st, &work, during)?;
    let mut out: Vec<Option<Tensor>> = (0..topo.world_size()).map(|_| None).collect();
    for (t, &rank) in local.iter().zip(topo.local_ranks()) {
        out[rank] = Some(collective::private_copy(t)?);
    }
    let nbytes = tensor.numel() * tensor.dtype().size();
    if topo.nodes().len() > 1 {
        // The other nodes' tensors, node after node, each node's by local rank.
        let remote: Vec<usize> = topo
            .nodes()
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != topo.node())
            .flat_map(|(_, n)| n.ranks().to_vec())
            .collect();
        let total = remote
            .len()
            .checked_mul(nbytes)
            .ok_or_else(|| Error::invalid_argument("all_gather size", "overflows"))?;
        let packed = if let Some(leaders) = &st.leaders {
            let mut packed = Vec::new();
            packed.try_reserve_exact(total).map_err(|_| Error::AllocationFailed { bytes: total })?;
            for (i, node) in topo.nodes().iter().enumerate() {
                let len = node
                    .ranks()
                    .len()
                    .checked_mul(nbytes)
                    .ok_or_else(|| Error::invalid_argument("all_gather size", "overflows"))?;
                let mut block = zeroed(len)?;
                if i == topo.node() {
                    for (k, t) in local.iter().enumerate() {
                        t.load_range(0, &mut block[k * nbytes..(k + 1) * nbytes])?;
                    }
                }
                net::broadcast_bytes(leaders, i, &mut block)?;
                if i != topo.node() {
                    packed.extend_from_slice(&block);
                }
            }
            let packed = collective::shared(&Tensor::from_vec(packed, &[total])?)?;
            hand_out(st, &packed, during)?;
            packed
        } else {
            let like = Tensor::try_meta(&[total], crate::DType::U8)?;
            receive(st, 0, &like, during)?
        };
        let mut buf = zeroed(nbytes)?;
        for (k, &rank) in remote.iter().enumerate() {
            packed.load_range(k * nbytes, &mut buf)?;
            out[rank] = Some(from_bytes(tensor, &buf)?);
        }
    }
    st.barrier(during)?;
    drop(local);
    out.into_iter().map(|t| t.ok_or_else(|| Error::invalid("all_gather missed a rank"))).collect()
}
