//! What crosses between nodes, through MPI: bytes (values serialized by value, the
//! elements of a tensor) and reductions among the nodes' leaders.
//!
//! MPI only ever reads and writes private buffers here, never shared memory (which other
//! processes may write meanwhile). Its counts are C `int`s, so everything moves in pieces of
//! at most [`PIECE`] bytes.

use mpi::collective::{CommunicatorCollectives, Root, SystemOperation};
use mpi::datatype::Equivalence;
use mpi::point_to_point::{Destination, Source};
use mpi::topology::{Communicator, SimpleCommunicator};

use super::reduce::ReduceOp;
use crate::{DType, Error, Result};

/// The most bytes one MPI call moves.
const PIECE: usize = 1 << 30;
/// A message up to this size travels with its length, in one MPI message.
const INLINE: usize = 64 * 1024;

/// `rank` as MPI's rank type.
pub(super) fn mpi_rank(rank: usize) -> Result<i32> {
    i32::try_from(rank).map_err(|_| Error::invalid_argument("rank", format!("{rank} is beyond MPI's ranks")))
}

/// Sends `bytes` to `dst` of `comm`: its length and, when small, the bytes in one message;
/// else the bytes follow in pieces.
pub(super) fn send_bytes(comm: &SimpleCommunicator, dst: usize, bytes: &[u8]) -> Result<()> {
    let to = comm.process_at_rank(mpi_rank(dst)?);
    let mut head = (bytes.len() as u64).to_le_bytes().to_vec();
    if bytes.len() <= INLINE {
        head.extend_from_slice(bytes);
        to.send(&head[..]);
        return Ok(());
    }
    to.send(&head[..]);
    for piece in bytes.chunks(PIECE) {
        to.send(piece);
    }
    Ok(())
}

/// Receives what [`send_bytes`] sent from `src` of `comm`, checking every length against
/// the announced one.
pub(super) fn recv_bytes(comm: &SimpleCommunicator, src: usize) -> Result<Vec<u8>> {
    let from = comm.process_at_rank(mpi_rank(src)?);
    let (head, _) = from.receive_vec::<u8>();
    let bad = |what: String| Error::invalid(format!("a message from rank {src}: {what}"));
    let (len, inline) =
        head.split_at_checked(8).ok_or_else(|| bad(format!("a head of {} bytes", head.len())))?;
    let total = u64::from_le_bytes(len.try_into().unwrap_or([0; 8]));
    let total = usize::try_from(total).map_err(|_| bad(format!("{total} bytes")))?;
    if total <= INLINE {
        if inline.len() != total {
            return Err(bad(format!("{} bytes, announced as {total}", inline.len())));
        }
        return Ok(inline.to_vec());
    }
    if !inline.is_empty() {
        return Err(bad("bytes in the head of a large message".into()));
    }
    // The buffer grows as pieces arrive, each once MPI has matched it: the length in the head
    // is only a claim, and memory follows the bytes the sender really sends.
    let mut out: Vec<u8> = Vec::new();
    while out.len() < total {
        let due = (total - out.len()).min(PIECE);
        let (message, status) = from.matched_probe();
        let count = usize::try_from(status.count(u8::equivalent_datatype())).unwrap_or(usize::MAX);
        if count != due {
            // Taken off the wire all the same, so that it cannot truncate into the buffer.
            let _ = mpi::point_to_point::MatchedReceiveVec::matched_receive_vec::<u8>((message, status));
            return Err(bad(format!("a piece of {count} bytes where {due} were due")));
        }
        let at = out.len();
        if out.capacity() - at < due {
            // Doubling, but never past the announced total, so that a genuine large message
            // does not ask for up to twice its size.
            let grow = at.max(due).min(total - at);
            out.try_reserve_exact(grow).map_err(|_| Error::AllocationFailed { bytes: at + grow })?;
        }
        out.resize(at + due, 0);
        message.matched_receive_into(&mut out[at..]);
    }
    Ok(out)
}

/// Broadcasts `data` from the leader of node `root` to every leader (`comm`, by node).
/// Every leader passes a buffer of the same length (the ranks agreed on it).
pub(super) fn broadcast_bytes(comm: &SimpleCommunicator, root: usize, data: &mut [u8]) -> Result<()> {
    let from = comm.process_at_rank(mpi_rank(root)?);
    for piece in data.chunks_mut(PIECE) {
        from.broadcast_into(piece);
    }
    Ok(())
}

/// Reduces `data` (elements of `dtype`, bytes) with `op` across the leaders (`comm`), in
/// place; `mean_of`: divide by this many ranks at the end.
///
/// Signed sums and products go as unsigned integers of the same width (the same bits,
/// wrapping, where C's signed overflow is undefined); f16 and bf16 go as f32.
pub(super) fn all_reduce(
    comm: &SimpleCommunicator,
    dtype: DType,
    op: ReduceOp,
    data: &mut [u8],
    mean_of: Option<usize>,
) -> Result<()> {
    let wraps = matches!(op, ReduceOp::Sum | ReduceOp::Product);
    let mpi_op = match op {
        ReduceOp::Sum | ReduceOp::Mean => SystemOperation::sum(),
        ReduceOp::Product => SystemOperation::product(),
        ReduceOp::Max => SystemOperation::max(),
        ReduceOp::Min => SystemOperation::min(),
    };
    match dtype {
        DType::F32 => {
            pieces::<f32, f32>(comm, data, mpi_op, |x| x, |y| y, mean_of.map(|n| move |y: f32| y / n as f32))
        }
        DType::F64 => {
            pieces::<f64, f64>(comm, data, mpi_op, |x| x, |y| y, mean_of.map(|n| move |y: f64| y / n as f64))
        }
        DType::F16 => pieces::<half::f16, f32>(
            comm,
            data,
            mpi_op,
            half::f16::to_f32,
            half::f16::from_f32,
            mean_of.map(|n| move |y: f32| y / n as f32),
        ),
        DType::BF16 => pieces::<half::bf16, f32>(
            comm,
            data,
            mpi_op,
            half::bf16::to_f32,
            half::bf16::from_f32,
            mean_of.map(|n| move |y: f32| y / n as f32),
        ),
        DType::U8 => same::<u8>(comm, data, mpi_op),
        DType::I8 if wraps => same::<u8>(comm, data, mpi_op),
        DType::I8 => same::<i8>(comm, data, mpi_op),
        DType::I16 if wraps => same::<u16>(comm, data, mpi_op),
        DType::I16 => same::<i16>(comm, data, mpi_op),
        DType::I32 if wraps => same::<u32>(comm, data, mpi_op),
        DType::I32 => same::<i32>(comm, data, mpi_op),
        DType::I64 if wraps => same::<u64>(comm, data, mpi_op),
        DType::I64 => same::<i64>(comm, data, mpi_op),
        DType::Bool => Err(Error::invalid_argument("dtype", "all_reduce of a bool tensor")),
    }
}

/// [`pieces`] of elements that travel as they are.
fn same<T: bytemuck::Pod + Equivalence>(
    comm: &SimpleCommunicator,
    data: &mut [u8],
    op: SystemOperation,
) -> Result<()> {
    pieces::<T, T>(comm, data, op, |x| x, |y| y, None::<fn(T) -> T>)
}

/// Reduces `data`, elements of `E`, as `W`s (`to` and `back` convert), a piece at a time.
fn pieces<E: bytemuck::Pod, W: bytemuck::Pod + Equivalence>(
    comm: &SimpleCommunicator,
    data: &mut [u8],
    op: SystemOperation,
    to: impl Fn(E) -> W,
    back: impl Fn(W) -> E,
    finish: Option<impl Fn(W) -> W>,
) -> Result<()> {
    let size = std::mem::size_of::<E>();
    let wire = std::mem::size_of::<W>();
    if data.len() % size != 0 {
        return Err(Error::invalid_argument(
            "all_reduce data",
            format!("{} bytes of {size}-byte elements", data.len()),
        ));
    }
    for piece in data.chunks_mut(PIECE / wire * size) {
        let send: Vec<W> = piece.chunks_exact(size).map(|b| to(bytemuck::pod_read_unaligned(b))).collect();
        let mut recv: Vec<W> = vec![W::zeroed(); send.len()];
        comm.all_reduce_into(&send[..], &mut recv[..], op);
        for (b, mut y) in piece.chunks_exact_mut(size).zip(recv) {
            if let Some(f) = &finish {
                y = f(y);
            }
            b.copy_from_slice(bytemuck::bytes_of(&back(y)));
        }
    }
    Ok(())
}
