//! `all_reduce`, hierarchical: within each node through shared memory, across nodes among
//! one leader per node through MPI, then the result shared within each node.
//!
//! A tensor that fits a board slot travels through the board: each rank copies it into its
//! slot, and after one barrier each rank reduces all slots into its own tensor (with
//! several nodes, the leader reduces, reduces across nodes, and posts the result). A larger
//! tensor does not move at all: the ranks of a node send each other their tensors as
//! handles, each rank reduces its share of the elements of all of them and writes the
//! result into all of them, and a barrier ends it. With several nodes the shares are
//! reduced into the leader's tensor first, which the leaders reduce across nodes, and the
//! ranks then copy their shares of it into the others.

use super::board::Area;
use super::collective::{self, agree, exchange};
use super::net;
use super::reduce::{reduce_block, ReduceOp, Scratch, BLOCK_BYTES};
use super::state::State;
use super::verdict::Kind;
use crate::{Result, Tensor};

/// `dist::all_reduce`: see there.
pub(super) fn all_reduce(st: &mut State, tensor: &mut Tensor, op: ReduceOp, during: &str) -> Result<()> {
    let mut refusal = collective::refusal(tensor).or_else(|| op.refuses(tensor.dtype()));
    // Exact: every tensor's byte size fits in isize.
    let bytes = tensor.numel() * tensor.dtype().size();
    let set = st.set();
    let small = bytes <= st.links()?.board.slot_len();
    let mut work = None;
    if refusal.is_none() {
        let ready =
            if small { post(st, tensor, set) } else { collective::shared(tensor).map(|w| work = Some(w)) };
        refusal = ready.err().map(|e| e.to_string());
    }
    agree(st, Kind::AllReduce(op), Some(tensor), refusal.as_deref(), during)?;
    if bytes == 0 {
        return Ok(());
    }
    let Some(work) = work else { return small_path(st, tensor, op, set, during) };
    large_path(st, &work, op, during)?;
    if !tensor.is_contiguous() {
        work.copy_into(tensor)?;
    }
    Ok(())
}

/// Copies `tensor` into this rank's slot of board set `set`.
fn post(st: &State, tensor: &Tensor, set: usize) -> Result<()> {
    let me = st.topo.local_rank();
    st.links()?.board.store(Area::Slot { set, rank: me }, 0, &tensor.to_bytes()?)
}

/// The mean's divisor on one node (every rank divides), or `None`.
fn mean_of(op: ReduceOp, ranks: usize) -> Option<usize> {
    (op == ReduceOp::Mean).then_some(ranks)
}

/// `load(k, offset, buf)`: fills `buf` with input `k`'s bytes from `offset` on.
type Load<'a> = dyn FnMut(usize, usize, &mut [u8]) -> Result<()> + 'a;
/// `put(offset, bytes)`: takes a block of the result.
type Put<'a> = dyn FnMut(usize, &[u8]) -> Result<()> + 'a;

/// Reduces elements `lo..hi` of `inputs` (by local rank) block by block and hands each
/// result block, with its byte offset, to `put`.
fn reduce_range(
    inputs: usize,
    dtype: crate::DType,
    op: ReduceOp,
    divide_by: Option<usize>,
    (lo, hi): (usize, usize),
    load: &mut Load<'_>,
    put: &mut Put<'_>,
) -> Result<()> {
    let size = dtype.size();
    let per_block = (BLOCK_BYTES / size).max(1);
    let mut scratch = Scratch::default();
    let mut at = lo;
    while at < hi {
        let count = per_block.min(hi - at);
        let offset = at * size;
        let out = reduce_block(
            dtype,
            op,
            divide_by,
            count,
            inputs,
            &mut |k, buf| load(k, offset, buf),
            &mut scratch,
        )?;
        put(offset, out)?;
        at += count;
    }
    Ok(())
}

fn small_path(st: &State, tensor: &mut Tensor, op: ReduceOp, set: usize, during: &str) -> Result<()> {
    let (dtype, numel) = (tensor.dtype(), tensor.numel());
    let n = st.topo.local_world_size();
    let board = &st.links()?.board;
    let mut result = collective::zeroed(numel * dtype.size())?;
    let mut load =
        |k: usize, offset: usize, buf: &mut [u8]| board.load(Area::Slot { set, rank: k }, offset, buf);
    if st.topo.nodes().len() == 1 {
        let mut put = |offset: usize, out: &[u8]| {
            result[offset..offset + out.len()].copy_from_slice(out);
            Ok(())
        };
        reduce_range(n, dtype, op, mean_of(op, n), (0, numel), &mut load, &mut put)?;
    } else {
        if let Some(leaders) = &st.leaders {
            let mut put = |offset: usize, out: &[u8]| {
                result[offset..offset + out.len()].copy_from_slice(out);
                Ok(())
            };
            reduce_range(n, dtype, op, None, (0, numel), &mut load, &mut put)?;
            net::all_reduce(leaders, dtype, op, &mut result, mean_of(op, st.topo.world_size()))?;
            board.store(Area::Result { set }, 0, &result)?;
        }
        st.barrier(during)?;
        board.load(Area::Result { set }, 0, &mut result)?;
    }
    write_back(tensor, &result)
}

/// Writes `bytes` (row-major elements) into `tensor`, whatever its strides.
fn write_back(tensor: &mut Tensor, bytes: &[u8]) -> Result<()> {
    if tensor.is_contiguous() {
        return tensor.store_range(0, bytes);
    }
    let mut tmp = Tensor::try_zeros(tensor.shape(), tensor.dtype())?;
    tmp.store_range(0, bytes)?;
    tmp.copy_into(tensor)
}

fn large_path(st: &State, work: &Tensor, op: ReduceOp, during: &str) -> Result<()> {
    let (dtype, numel) = (work.dtype(), work.numel());
    let (n, me) = (st.topo.local_world_size(), st.topo.local_rank());
    let mut all = exchange(st, work, during)?;
    let mine = collective::share(numel, dtype.size(), n, me);
    let load = |all: &[Tensor], k: usize, offset: usize, buf: &mut [u8]| all[k].load_range(offset, buf);
    if st.topo.nodes().len() == 1 {
        let snapshot = all.clone();
        let mut put = |offset: usize, out: &[u8]| all.iter_mut().try_for_each(|t| t.store_range(offset, out));
        reduce_range(n, dtype, op, mean_of(op, n), mine, &mut |k, o, b| load(&snapshot, k, o, b), &mut put)?;
        return st.barrier(during);
    }
    let snapshot = all.clone();
    let mut put = |offset: usize, out: &[u8]| all[0].store_range(offset, out);
    reduce_range(n, dtype, op, None, mine, &mut |k, o, b| load(&snapshot, k, o, b), &mut put)?;
    st.barrier(during)?;
    if let Some(leaders) = &st.leaders {
        across_nodes(leaders, work, op, st.topo.world_size())?;
    }
    st.barrier(during)?;
    let mut buf = Vec::new();
    let size = dtype.size();
    let (lo, hi) = mine;
    let mut at = lo;
    while at < hi {
        let count = (BLOCK_BYTES / size).max(1).min(hi - at);
        buf.resize(count * size, 0);
        all[0].load_range(at * size, &mut buf)?;
        all[1..].iter_mut().try_for_each(|t| t.store_range(at * size, &buf))?;
        at += count;
    }
    st.barrier(during)
}

/// The leader's step: reduces its tensor (the node's sums) with the other nodes' leaders,
/// a private piece at a time.
fn across_nodes(
    leaders: &mpi::topology::SimpleCommunicator,
    work: &Tensor,
    op: ReduceOp,
    world: usize,
) -> Result<()> {
    const PIECE: usize = 16 << 20;
    let size = work.dtype().size();
    let total = work.numel() * size;
    let mut work = work.clone();
    let mut buf = Vec::new();
    let mut at = 0;
    while at < total {
        let len = (PIECE / size * size).min(total - at);
        buf.resize(len, 0);
        work.load_range(at, &mut buf)?;
        net::all_reduce(leaders, work.dtype(), op, &mut buf, mean_of(op, world))?;
        work.store_range(at, &buf)?;
        at += len;
    }
    Ok(())
}
