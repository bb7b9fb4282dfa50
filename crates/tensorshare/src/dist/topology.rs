//! [`Topology`]: which ranks share a node, learnt from MPI at `init`.
//!
//! A node is what MPI calls shared memory (`MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)`):
//! the ranks its launcher started on one host. Nodes are numbered in the order of their
//! lowest rank, ranks of a node by rank (its local ranks), and the lowest rank of a node
//! is its leader.

use mpi::collective::{CommunicatorCollectives, Root};
use mpi::topology::{Communicator, SimpleCommunicator};

use super::DistError;
use crate::Result;

/// Where the ranks of the job run: this rank, and every node with its ranks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Topology {
    rank: usize,
    world_size: usize,
    local_rank: usize,
    node: usize,
    nodes: Vec<Node>,
    node_of: Vec<usize>,
    pids: Vec<u32>,
}

/// A node: a host whose ranks share memory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Node {
    name: String,
    ranks: Vec<usize>,
}

impl Node {
    /// The host name of the node (its leader's `uname -n`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The ranks on this node, in order of their local ranks.
    pub fn ranks(&self) -> &[usize] {
        &self.ranks
    }
}

impl Topology {
    /// This process's rank, `0..world_size()`.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The number of ranks in the job.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// This rank's index among the ranks of its node.
    pub fn local_rank(&self) -> usize {
        self.local_rank
    }

    /// The number of ranks on this rank's node.
    pub fn local_world_size(&self) -> usize {
        self.nodes[self.node].ranks.len()
    }

    /// This rank's node, an index into [`Topology::nodes`].
    pub fn node(&self) -> usize {
        self.node
    }

    /// The node of `rank`, if there is such a rank.
    pub fn node_of(&self, rank: usize) -> Option<usize> {
        self.node_of.get(rank).copied()
    }

    /// Every node, in order of their lowest rank.
    pub fn nodes(&self) -> &[Node] {
        &self.nodes
    }

    /// The process id of `rank` (on its own node).
    pub(super) fn pid(&self, rank: usize) -> u32 {
        self.pids.get(rank).copied().unwrap_or(0)
    }

    /// The ranks of this rank's node, by local rank.
    pub(super) fn local_ranks(&self) -> &[usize] {
        &self.nodes[self.node].ranks
    }

    /// The local rank of `rank`, when it is on this node.
    pub(super) fn local_index(&self, rank: usize) -> Option<usize> {
        self.local_ranks().iter().position(|&r| r == rank)
    }

    /// The error for `rank` gone during `during`.
    pub(super) fn gone(&self, rank: usize, during: &str) -> DistError {
        let node = self.node_of(rank).unwrap_or(self.node);
        DistError::RankGone {
            rank,
            pid: self.pid(rank),
            node,
            host: self.nodes.get(node).map(|n| n.name.clone()).unwrap_or_default(),
            during: during.to_owned(),
        }
    }
}

/// Bytes of a host name as gathered (longer names are cut).
const NAME: usize = 64;

/// The topology, from the world, this rank's node (`local`) and, on leaders, the
/// communicator of leaders. Collective: every rank calls it.
pub(super) fn build(
    world: &SimpleCommunicator,
    local: &SimpleCommunicator,
    leaders: Option<&SimpleCommunicator>,
) -> Result<Topology> {
    let as_usize = |v: i32| usize::try_from(v).unwrap_or(usize::MAX);
    let (rank, world_size, local_rank) =
        (as_usize(world.rank()), as_usize(world.size()), as_usize(local.rank()));
    let mut node = [leaders.map_or(0, |l| l.rank() as i64)];
    local.process_at_rank(0).broadcast_into(&mut node[..]);
    let mine = [u64::try_from(node[0]).unwrap_or(u64::MAX), local_rank as u64, u64::from(std::process::id())];
    let mut all = vec![0u64; 3 * world_size];
    world.all_gather_into(&mine[..], &mut all[..]);
    let mut name = [0u8; NAME];
    let host = rustix::system::uname();
    let host = host.nodename().to_bytes();
    let n = host.len().min(NAME);
    name[..n].copy_from_slice(&host[..n]);
    let mut names = vec![0u8; NAME * world_size];
    world.all_gather_into(&name[..], &mut names[..]);

    let broken = |what: String| DistError::Broken(format!("MPI reported an inconsistent job: {what}"));
    let node_of: Vec<usize> = all.chunks(3).map(|c| usize::try_from(c[0]).unwrap_or(usize::MAX)).collect();
    let count = node_of.iter().copied().max().map_or(0, |m| m.saturating_add(1));
    if count > world_size {
        return Err(broken(format!("node numbers {node_of:?} for {world_size} ranks")).into());
    }
    let mut nodes: Vec<Node> = (0..count).map(|_| Node { name: String::new(), ranks: Vec::new() }).collect();
    // Ranks in increasing order: each node's list is ordered by rank, which is the order of
    // local ranks (split with the world rank as key).
    for (r, &nd) in node_of.iter().enumerate() {
        nodes[nd].ranks.push(r);
    }
    for (nd, n) in nodes.iter_mut().enumerate() {
        let Some(&leader) = n.ranks.first() else {
            return Err(broken(format!("node {nd} has no ranks")).into());
        };
        let raw = &names[leader * NAME..(leader + 1) * NAME];
        let end = raw.iter().position(|&b| b == 0).unwrap_or(NAME);
        n.name = String::from_utf8_lossy(&raw[..end]).into_owned();
        for (k, &r) in n.ranks.iter().enumerate() {
            if all[3 * r + 1] != k as u64 {
                return Err(broken(format!(
                    "rank {r} has local rank {} on node {nd}, not {k}",
                    all[3 * r + 1]
                ))
                .into());
            }
        }
    }
    let pids = all.chunks(3).map(|c| u32::try_from(c[2]).unwrap_or(0)).collect();
    let node = node_of.get(rank).copied().ok_or_else(|| broken(format!("rank {rank} of {world_size}")))?;
    Ok(Topology { rank, world_size, local_rank, node, nodes, node_of, pids })
}
