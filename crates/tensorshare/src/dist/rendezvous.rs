//! How the ranks of a node find each other: MPI starts them as unrelated processes, so
//! they meet once, at `init`, on a socket of the node's leader.
//!
//! The leader listens on an abstract AF_UNIX socket with a random name (abstract names
//! leave no file behind, and live in the network namespace: the node's), makes the node's
//! board, and tells its ranks the name through MPI. Each rank connects; the leader
//! accepts only a connection whose peer (SO_PEERCRED, recorded by the kernel) is one of
//! the node's ranks, by the pid MPI reported for it, and of this user; a rank checks the
//! same of the leader. Then the leader makes two socket pairs for every pair of ranks and
//! sends each rank its ends and the board, as one tensorshare message (SCM_RIGHTS). The
//! listening socket is closed as soon as every rank has come.

use std::os::fd::{AsFd, OwnedFd};
use std::time::{Duration, Instant};

use mpi::collective::Root;
use mpi::topology::{Communicator, SimpleCommunicator};
use rustix::event::PollFlags;
use rustix::io::Errno;
use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};
use serde::{Deserialize, Serialize};

use super::board::{self, Board};
use super::links::{NodeLinks, Peer};
use super::topology::Topology;
use super::DistError;
use crate::channel::socket;
use crate::{Connection, Error, Result, Storage};

/// How long the ranks of a node may take to meet.
const RENDEZVOUS: Duration = Duration::from_secs(120);
/// The name's prefix; 32 random hex digits follow.
const PREFIX: &[u8] = b"tensorshare-dist-";
/// Bytes of the announcement: a status byte, then the name.
const ANNOUNCE: usize = 64;

/// One rank's ends: for every local rank, the (p2p, collective) sockets to it; `None` for
/// itself.
type Ends = Vec<Option<(Connection<()>, Connection<()>)>>;

/// What the leader sends each rank.
#[derive(Serialize, Deserialize)]
struct Setup {
    board: Storage,
    links: Ends,
}

/// Connects this rank to the other ranks of its node (`local`, split by MPI). Collective
/// over `local`.
pub(super) fn connect(local: &SimpleCommunicator, topo: &Topology) -> Result<NodeLinks> {
    let n = topo.local_world_size();
    if n == 1 {
        return Ok(NodeLinks {
            me: 0,
            peers: vec![None],
            board: board::create(1)?,
            patience: Default::default(),
        });
    }
    if topo.local_rank() == 0 {
        lead(local, topo, n)
    } else {
        follow(local, topo, n)
    }
}

fn lead(local: &SimpleCommunicator, topo: &Topology, n: usize) -> Result<NodeLinks> {
    let ready = listen().and_then(|(sock, name)| Ok((sock, name, board::create(n)?)));
    let mut announce = [0u8; ANNOUNCE];
    if let Ok((_, name, _)) = &ready {
        announce[0] = 1;
        announce[1..1 + name.len()].copy_from_slice(name);
    }
    local.process_at_rank(0).broadcast_into(&mut announce[..]);
    let (listener, _, board) = ready?;
    let accepted = accept_all(&listener, topo, n)?;
    drop(listener);
    // ends[i][j]: rank i's ends of its two pairs with rank j.
    let mut ends: Vec<Ends> = (0..n).map(|_| (0..n).map(|_| None).collect()).collect();
    for (i, j) in (0..n).flat_map(|i| (i + 1..n).map(move |j| (i, j))) {
        let (pi, pj) = socket::pair()?;
        let (ci, cj) = socket::pair()?;
        ends[i][j] = Some((Connection::from_socket(pi), Connection::from_socket(ci)));
        ends[j][i] = Some((Connection::from_socket(pj), Connection::from_socket(cj)));
    }
    let mut ends = ends.into_iter();
    let own = ends.next().unwrap_or_default();
    for (links, sock) in ends.zip(accepted) {
        let conn: Connection<Setup> = Connection::from_socket(sock);
        conn.send(Setup { board: board.storage().clone(), links })?;
    }
    Ok(NodeLinks { me: 0, peers: peers(topo, own), board, patience: Default::default() })
}

fn follow(local: &SimpleCommunicator, topo: &Topology, n: usize) -> Result<NodeLinks> {
    let leader = topo.local_ranks()[0];
    let mut announce = [0u8; ANNOUNCE];
    local.process_at_rank(0).broadcast_into(&mut announce[..]);
    let failed = |what: String| -> Error {
        DistError::Broken(format!("init: {what} (node {}, leader rank {leader})", topo.node())).into()
    };
    if announce[0] != 1 {
        return Err(failed("the node's leader could not open its rendezvous socket".into()));
    }
    let name = &announce[1..1 + PREFIX.len() + 32];
    let sock = connect_to(name).map_err(|e| {
        failed(format!(
            "cannot reach the leader's socket ({e}): MPI places these ranks on one node, so they must \
             share a network namespace"
        ))
    })?;
    let cred = rustix::net::sockopt::socket_peercred(&sock).map_err(|e| Error::io("SO_PEERCRED", e))?;
    if cred.pid.as_raw_nonzero().get() as u32 != topo.pid(leader) || cred.uid != rustix::process::getuid() {
        return Err(failed(format!(
            "the rendezvous socket belongs to pid {} (uid {}), not to the leader (pid {})",
            cred.pid.as_raw_nonzero(),
            cred.uid.as_raw(),
            topo.pid(leader)
        )));
    }
    let conn: Connection<Setup> = Connection::from_socket(sock);
    let setup = match conn.recv_timeout(RENDEZVOUS) {
        Ok(s) => s,
        Err(Error::Disconnected) => return Err(topo.gone(leader, "init").into()),
        Err(Error::Timeout) => return Err(failed(format!("no word from the leader in {RENDEZVOUS:?}"))),
        Err(e) => return Err(e),
    };
    let me = topo.local_rank();
    let shaped =
        setup.links.len() == n && setup.links.iter().enumerate().all(|(i, l)| l.is_some() == (i != me));
    if !shaped {
        return Err(Error::invalid(format!(
            "the leader's setup names {} links for {n} ranks",
            setup.links.len()
        )));
    }
    let board = Board::new(setup.board, n)?;
    Ok(NodeLinks { me, peers: peers(topo, setup.links), board, patience: Default::default() })
}

/// The links of a setup as peers.
fn peers(topo: &Topology, links: Ends) -> Vec<Option<Peer>> {
    links
        .into_iter()
        .zip(topo.local_ranks())
        .map(|(l, &rank)| {
            l.map(|(p, c)| Peer {
                rank,
                p2p: p.socket().clone(),
                coll: c.socket().clone(),
                pidfd: pidfd(topo, rank),
                inbox: Default::default(),
                route: Default::default(),
            })
        })
        .collect()
}

/// A pidfd of `rank`'s process, by the pid the rank reported; none where the kernel has no
/// pidfds (before 5.3) or the process is already gone (its sockets then tell).
fn pidfd(topo: &Topology, rank: usize) -> Option<OwnedFd> {
    let pid = rustix::process::Pid::from_raw(i32::try_from(topo.pid(rank)).ok()?)?;
    rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::empty()).ok()
}

/// A listening socket with a fresh random abstract name, and the name.
fn listen() -> Result<(OwnedFd, Vec<u8>)> {
    let mut random = [0u8; 16];
    crate::util::random_bytes(&mut random);
    let mut name = PREFIX.to_vec();
    name.extend(random.iter().flat_map(|b| format!("{b:02x}").into_bytes()));
    let addr =
        SocketAddrUnix::new_abstract_name(&name).map_err(|e| Error::io("an abstract socket name", e))?;
    let sock = rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::SEQPACKET,
        SocketFlags::CLOEXEC | SocketFlags::NONBLOCK,
        None,
    )
    .map_err(|e| Error::io("socket(AF_UNIX, SOCK_SEQPACKET)", e))?;
    rustix::net::bind(&sock, &addr).map_err(|e| Error::io("bind of the node's rendezvous socket", e))?;
    rustix::net::listen(&sock, 128).map_err(|e| Error::io("listen", e))?;
    Ok((sock, name))
}

fn connect_to(name: &[u8]) -> Result<OwnedFd> {
    let addr =
        SocketAddrUnix::new_abstract_name(name).map_err(|e| Error::io("an abstract socket name", e))?;
    let sock =
        rustix::net::socket_with(AddressFamily::UNIX, SocketType::SEQPACKET, SocketFlags::CLOEXEC, None)
            .map_err(|e| Error::io("socket(AF_UNIX, SOCK_SEQPACKET)", e))?;
    rustix::net::connect(&sock, &addr).map_err(|e| Error::io("connect", e))?;
    rustix::io::ioctl_fionbio(&sock, true).map_err(|e| Error::io("FIONBIO", e))?;
    Ok(sock)
}

/// Accepts one connection from each other rank of the node, by local rank (from 1).
/// Connections from other processes are closed and ignored.
fn accept_all(listener: &OwnedFd, topo: &Topology, n: usize) -> Result<Vec<OwnedFd>> {
    let uid = rustix::process::getuid();
    let mut accepted: Vec<Option<OwnedFd>> = (1..n).map(|_| None).collect();
    let deadline = Instant::now() + RENDEZVOUS;
    while accepted.iter().any(Option::is_none) {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            let missing: Vec<usize> =
                (1..n).filter(|&k| accepted[k - 1].is_none()).map(|k| topo.local_ranks()[k]).collect();
            return Err(DistError::Broken(format!(
                "init: ranks {missing:?} did not reach node {}'s rendezvous socket in {RENDEZVOUS:?}",
                topo.node()
            ))
            .into());
        }
        socket::wait(listener.as_fd(), PollFlags::IN, left.min(Duration::from_secs(1)))?;
        let sock = match rustix::net::accept_with(listener, SocketFlags::CLOEXEC | SocketFlags::NONBLOCK) {
            Ok(s) => s,
            Err(Errno::AGAIN) | Err(Errno::INTR) | Err(Errno::CONNABORTED) => continue,
            Err(e) => return Err(Error::io("accept on the node's rendezvous socket", e)),
        };
        let Ok(cred) = rustix::net::sockopt::socket_peercred(&sock) else { continue };
        let pid = cred.pid.as_raw_nonzero().get() as u32;
        let from = (1..n).find(|&k| topo.pid(topo.local_ranks()[k]) == pid);
        if let (Some(k), true) = (from, cred.uid == uid) {
            if accepted[k - 1].is_none() {
                accepted[k - 1] = Some(sock);
            }
        }
    }
    Ok(accepted.into_iter().flatten().collect())
}
