//! Distributed communication on MPI (feature `mpi`): torch.distributed for tensorshare.
//!
//! A job is ranks started by an MPI launcher (`mpirun -np 4 prog`; a program started alone
//! is a job of one rank). Ranks on one node share memory: values they send each other are
//! tensorshare messages through a queue for each pair of ranks, so tensors travel as arena
//! handles, never copied, exactly as through a [`Queue`](crate::Queue). Ranks on different
//! nodes send through MPI, tensors by value. Collectives are hierarchical: within each node
//! through shared memory, across nodes among one leader per node through MPI.
//!
//! ```no_run
//! use tensorshare::dist::{self, ReduceOp};
//! use tensorshare::{DType, Tensor};
//!
//! fn main() -> tensorshare::Result<()> {
//!     tensorshare::init(); // workers started by this rank run their job here
//!     let _session = dist::init()?; // MPI ends when it goes
//!     let (rank, size) = (dist::rank()?, dist::world_size()?);
//!     let mut grad = Tensor::full(&[1024], rank as f32);
//!     dist::all_reduce(&mut grad, ReduceOp::Mean)?;
//!     if rank == 0 {
//!         dist::send(&("step", grad), 1 % size)?; // any serde value holding tensors
//!     } else if rank == 1 {
//!         let (_what, _t): (String, Tensor) = dist::recv(0)?;
//!     }
//!     let mut weights = Tensor::zeros(&[4, 4], DType::F32);
//!     dist::broadcast(&mut weights, 0)?;
//!     let _all: Vec<Tensor> = dist::all_gather(&weights)?;
//!     dist::barrier()
//! }
//! ```
//!
//! # Launching, and tensorshare's workers
//! `mpirun -np N prog` (and `srun`, or any launcher of the installed Open MPI) works as is:
//! [`init`] reads the launcher's environment through `MPI_Init`. Every rank runs `main`, so
//! [`crate::init`] stays its first line. A rank may start workers with
//! [`spawn`](crate::spawn) and [`Pool`](crate::Pool) as any program does: they run inside
//! the rank, on its node, and are not ranks (`dist` in a worker is
//! [`DistError::NotInitialized`]). A worker hands its tensors to its rank through a queue,
//! in shared memory, and the rank sends them on: to a rank of the same node as handles,
//! so a tensor a worker made reaches another rank of the node without a copy.
//!
//! # When something is wrong
//! Every rank posts what it calls before a collective moves any data, so ranks that call
//! different collectives, or give tensors of different dtypes or shapes, or cannot take part
//! (a tensor on a device, a dtype an operation cannot reduce) all get the same error
//! ([`DistError::Mismatch`], [`DistError::Refused`]) and the group stays usable.
//!
//! A rank that dies: by default `mpirun` ends the whole job as soon as a rank exits with
//! an error or is killed, and names it (`mpirun noticed that process rank 2 with PID 0 on
//! node vm exited on signal 9`; or a survivor that already left with the error below, whose
//! message names the dead rank). Within a node tensorshare notices it on its own: the
//! kernel closes a dead rank's sockets, and every wait here (a receive, a barrier)
//! watches them, so the ranks of its node get [`DistError::RankGone`], naming it, within
//! about 50 ms, and the group is then broken (every later call returns that error). With
//! `mpirun --enable-recovery` the launcher lets the survivors run, and they see the error.
//! Across nodes the waiting is MPI's, and Open MPI's runtime is what notices: it ends the
//! job (with `--enable-recovery`, a leader waiting in MPI on a dead node waits until then).
//!
//! Calls come from the thread that called [`init`] (MPI runs as `MPI_THREAD_FUNNELED`);
//! [`rank`], [`world_size`], [`local_rank`] and [`topology`] work from any thread.

mod allreduce;
mod board;
mod collective;
mod gather;
mod links;
mod net;
mod p2p;
mod reduce;
mod rendezvous;
mod state;
mod topology;
mod verdict;

use serde::de::DeserializeOwned;
use serde::Serialize;

pub use crate::error::DistError;
pub use reduce::ReduceOp;
pub use state::Session;
pub use topology::{Node, Topology};

use crate::{Result, Tensor};

/// Makes this process a rank of the job: initialises MPI from the launcher's environment,
/// learns which ranks share its node and connects to them. Collective: every rank calls it
/// once, from the thread that will call the rest of `dist`. The returned [`Session`]
/// finalises MPI when dropped.
///
/// Fails with [`DistError::NotInitialized`] in a tensorshare worker, in a process where MPI
/// was initialised by other code, or on a second call.
pub fn init() -> Result<Session> {
    state::init()
}

/// This process's rank, `0..world_size()` (torch's `get_rank`).
pub fn rank() -> Result<usize> {
    Ok(state::topology()?.rank())
}

/// The number of ranks in the job (torch's `get_world_size`).
pub fn world_size() -> Result<usize> {
    Ok(state::topology()?.world_size())
}

/// This rank's index among the ranks of its node (torch's `LOCAL_RANK`).
pub fn local_rank() -> Result<usize> {
    Ok(state::topology()?.local_rank())
}

/// The nodes of the job and their ranks.
pub fn topology() -> Result<Topology> {
    Ok((*state::topology()?).clone())
}

/// Sends `value` to rank `dst`, which receives it with [`recv`]. Any serde value holding
/// tensors: to a rank on this node tensors go as handles (a private tensor moves into
/// shared memory in place, as with a [`Queue`](crate::Queue), so both ranks then see the
/// same elements), to a rank on another node by value. Queues and pipes inside `value`
/// reach ranks of this node only. Values from one rank to another arrive in order.
///
/// Returns once the value is on its way, not when it is received. To a rank of this node,
/// waits while 64 values this rank sent it are still unreceived, and fails with
/// [`DistError::RankGone`] if that rank is seen gone; a value sent to a rank that dies
/// before receiving it is lost, and the next [`recv`] from that rank, or the next
/// collective, names it.
pub fn send<T: Serialize + ?Sized>(value: &T, dst: usize) -> Result<()> {
    let during = format!("send to rank {dst}");
    state::point_to_point(&during, |st| p2p::send(st, value, dst, &during))
}

/// Receives the next value rank `src` sent with [`send`], as a `T` (the type it sent),
/// waiting as long as it takes; fails with [`DistError::RankGone`] if `src` is a rank of
/// this node that is gone.
pub fn recv<T: DeserializeOwned>(src: usize) -> Result<T> {
    let during = format!("recv from rank {src}");
    state::point_to_point(&during, |st| p2p::recv(st, src, &during))
}

/// Copies rank `src`'s tensor into `tensor` on every other rank (torch's `broadcast`). Every
/// rank passes a tensor of the same dtype and shape, any strides. The source's tensor, if
/// contiguous, moves into shared memory in place (as sending does) and its node's ranks copy
/// from it directly.
pub fn broadcast(tensor: &mut Tensor, src: usize) -> Result<()> {
    let during = format!("broadcast from rank {src}");
    state::collective(&during, |st| gather::broadcast(st, tensor, src, &during))
}

/// Reduces `tensor` across all ranks with `op`, in place: afterwards every rank's tensor
/// holds the result (torch's `all_reduce`). Every rank passes a tensor of the same dtype
/// and shape, any strides; a contiguous one larger than a few hundred KiB is moved into
/// shared memory in place (as sending does) and reduced there without a copy.
///
/// Dtypes: f32, f64, f16, bf16 (accumulated in f32), u8, i8, i16, i32, i64 (wrapping);
/// [`ReduceOp::Mean`] on floating-point dtypes only.
pub fn all_reduce(tensor: &mut Tensor, op: ReduceOp) -> Result<()> {
    let during = format!("all_reduce ({})", op.name());
    state::collective(&during, |st| allreduce::all_reduce(st, tensor, op, &during))
}

/// Every rank's `tensor`, by rank, as private copies (torch's `all_gather`). Every rank
/// passes a tensor of the same dtype and shape; a contiguous one moves into shared memory in
/// place (as sending does), and the ranks of its node copy from it directly.
pub fn all_gather(tensor: &Tensor) -> Result<Vec<Tensor>> {
    state::collective("all_gather", |st| gather::all_gather(st, tensor, "all_gather"))
}

/// Returns once every rank has called it (torch's `barrier`).
pub fn barrier() -> Result<()> {
    state::collective("barrier", |st| collective::agree(st, verdict::Kind::Barrier, None, None, "barrier"))
}

/// What crosses between nodes, raw, for tests of a hostile rank on another node (feature
/// `test-support`; not part of the API).
#[cfg(feature = "test-support")]
#[doc(hidden)]
pub mod raw {
    use mpi::point_to_point::Destination;
    use mpi::topology::Communicator;

    use crate::Result;

    /// Sends each of `pieces` to `dst` as one MPI message on the communicator that carries
    /// `send` between nodes: a head and pieces that may lie about each other.
    pub fn send_pieces(dst: usize, pieces: &[&[u8]]) -> Result<()> {
        super::state::point_to_point("raw send", |st| {
            if dst >= st.topo.world_size() {
                return Err(crate::Error::invalid_argument("destination", format!("rank {dst}")));
            }
            let to = st.world.process_at_rank(super::net::mpi_rank(dst)?);
            for piece in pieces {
                to.send(*piece);
            }
            Ok(())
        })
    }

    /// Receives a message from `src` as a rank on another node would: the bytes of a value.
    pub fn recv_bytes(src: usize) -> Result<Vec<u8>> {
        super::state::point_to_point("raw recv", |st| super::net::recv_bytes(&st.world, src))
    }
}
