//! The steps every collective shares: agreeing on what is called, handing tensors to the
//! node's other ranks, and the small checks before.

use mpi::collective::CommunicatorCollectives;
use serde::{Deserialize, Serialize};

use super::board::{Area, RECORD_WORDS};
use super::links::Channel;
use super::state::State;
use super::verdict::{self, Kind, Sig, Verdict};
use super::DistError;
use crate::{Device, Result, Tensor};

/// What one rank hands another inside a collective.
#[derive(Serialize, Deserialize)]
pub(super) enum CollMsg {
    /// A tensor, as a handle.
    Tensor(Tensor),
    /// The sender could not send its tensor: it leaves the process group.
    Failed(String),
}

/// Why `tensor` cannot take part in a collective, if it cannot.
pub(super) fn refusal(tensor: &Tensor) -> Option<String> {
    match tensor.device() {
        Device::Cpu => None,
        d => Some(format!(
            "its tensor is on the {d} device: collectives move host tensors (copy it to the host)"
        )),
    }
}

/// `tensor` as a contiguous tensor in shared memory: `tensor` itself (moved into shared
/// memory in place, as sending does) when it is contiguous, else a shared copy.
pub(super) fn shared(tensor: &Tensor) -> Result<Tensor> {
    let mut work = tensor.contiguous()?;
    work.share_memory()?;
    Ok(work)
}

/// A private contiguous copy of `t`.
pub(super) fn private_copy(t: &Tensor) -> Result<Tensor> {
    let mut c = Tensor::try_zeros(t.shape(), t.dtype())?;
    t.copy_into(&mut c)?;
    Ok(c)
}

/// Every rank of the job posts `kind` on its tensor (with `refusal`, if it cannot take
/// part); returns when all have, with an error on every rank if they do not all call the
/// same or one refuses. Every collective starts here: it is also where they all meet.
pub(super) fn agree(
    st: &mut State,
    kind: Kind,
    tensor: Option<&Tensor>,
    refusal: Option<&str>,
    during: &str,
) -> Result<()> {
    let set = st.set();
    st.seq = st.seq.wrapping_add(1);
    let sig: Sig = verdict::signature(kind, tensor.map(|t| (t.dtype(), t.shape())));
    let me = st.topo.local_rank();
    let n = st.topo.local_world_size();
    let links = st.links()?;
    links.board.store_words(Area::Record { set, rank: me }, &verdict::record(&sig, refusal))?;
    st.barrier(during)?;
    let links = st.links()?;
    let records =
        (0..n).map(|rank| links.board.load_words(Area::Record { set, rank })).collect::<Result<Vec<_>>>()?;
    let local = Verdict::of_records(&records, st.topo.local_ranks());
    let verdict = if st.topo.nodes().len() == 1 {
        local
    } else {
        if let Some(leaders) = &st.leaders {
            let mine = local.to_words();
            let mut all = vec![0u64; RECORD_WORDS * st.topo.nodes().len()];
            leaders.all_gather_into(&mine[..], &mut all[..]);
            let nodes: Vec<Verdict> = all
                .chunks_exact(RECORD_WORDS)
                .map(|c| Verdict::from_words(c.try_into().unwrap_or(&[0; RECORD_WORDS])))
                .collect();
            links.board.store_words(Area::Verdict { set }, &Verdict::of_nodes(&nodes).to_words())?;
        }
        st.barrier(during)?;
        Verdict::from_words(&st.links()?.board.load_words(Area::Verdict { set })?)
    };
    verdict.into_result(&sig).map_err(Into::into)
}

/// Sends `t` (shared) to every other rank of the node. If it cannot be sent, the others are
/// told why (they leave the group with that reason) before the error returns.
pub(super) fn hand_out(st: &State, t: &Tensor, during: &str) -> Result<()> {
    let links = st.links()?;
    let me = st.topo.local_rank();
    let others = || (0..st.topo.local_world_size()).filter(move |&k| k != me);
    for k in others() {
        if let Err(e) = links.send(&st.topo, k, Channel::Coll, &CollMsg::Tensor(t.clone()), during) {
            for k in others() {
                let _ = links.send(&st.topo, k, Channel::Coll, &CollMsg::Failed(e.to_string()), during);
            }
            return Err(e);
        }
    }
    Ok(())
}

/// Sends `mine` (contiguous, shared) to every other rank of the node and returns every
/// rank's tensor, by local rank (this rank's is `mine`). They must all have `mine`'s
/// dtype and shape, as the ranks agreed.
pub(super) fn exchange(st: &State, mine: &Tensor, during: &str) -> Result<Vec<Tensor>> {
    hand_out(st, mine, during)?;
    let me = st.topo.local_rank();
    (0..st.topo.local_world_size())
        .map(|k| if k == me { Ok(mine.clone()) } else { receive(st, k, mine, during) })
        .collect()
}

/// `len` zeroed bytes, or an error if they cannot be allocated.
pub(super) fn zeroed(len: usize) -> Result<Vec<u8>> {
    let mut v = Vec::new();
    v.try_reserve_exact(len).map_err(|_| crate::Error::AllocationFailed { bytes: len })?;
    v.resize(len, 0);
    Ok(v)
}

/// A tensor from local rank `from`, which must be like `like` (dtype and shape).
pub(super) fn receive(st: &State, from: usize, like: &Tensor, during: &str) -> Result<Tensor> {
    let rank = st.topo.local_ranks().get(from).copied().unwrap_or(usize::MAX);
    match st.links()?.recv::<CollMsg>(&st.topo, from, Channel::Coll, during)? {
        CollMsg::Tensor(t) if t.dtype() == like.dtype() && t.shape() == like.shape() && t.is_contiguous() => {
            Ok(t)
        }
        CollMsg::Tensor(t) => Err(DistError::Broken(format!(
            "{during}: rank {rank} sent a {} tensor of shape {:?}, not {} {:?} as agreed",
            t.dtype(),
            t.shape(),
            like.dtype(),
            like.shape()
        ))
        .into()),
        CollMsg::Failed(why) => Err(DistError::Broken(format!("{during}: rank {rank} failed: {why}")).into()),
    }
}

/// The first element and the end of local rank `k`'s share of `numel` elements of `size`
/// bytes among `n` ranks: equal shares, each a whole number of 64-byte lines where it can
/// be, so that no two ranks write one cache line.
pub(super) fn share(numel: usize, size: usize, n: usize, k: usize) -> (usize, usize) {
    let line = (64 / size).max(1);
    let each = numel.div_ceil(n).div_ceil(line).saturating_mul(line);
    let lo = each.saturating_mul(k).min(numel);
    (lo, each.saturating_mul(k + 1).min(numel))
}

#[cfg(test)]
mod tests {
    use super::share;

    #[test]
    fn shares_cover_every_element_once() {
        for (numel, size, n) in [(0, 4, 3), (1, 4, 4), (1000, 4, 3), (17, 8, 4), (1 << 20, 2, 7)] {
            let mut next = 0;
            for k in 0..n {
                let (lo, hi) = share(numel, size, n, k);
                assert_eq!(lo, next.min(numel));
                assert!(hi >= lo);
                next = hi;
            }
            assert_eq!(next, numel);
        }
    }
}
