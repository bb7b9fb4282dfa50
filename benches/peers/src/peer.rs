//! The other process of an ipc-channel or iceoryx2 run: this program again, started with
//! `PEER_ROLE` and the run's words. (tensorshare's side starts its own with
//! `tensorshare::spawn`, the way its users do.)
//!
//! The child holds its end until the parent closes the child's stdin: a consumer may still
//! be reading what a producer sent, and the producer's ports must outlive that.

use std::io::{Read, Write};
use std::process::{Child, ChildStdin, Command, Stdio};

use crate::work::{Ctx, Res};

/// The first argument that makes this program a peer process.
pub const PEER_ROLE: &str = "__peer";

/// A running peer process; dropping it kills and reaps the process if it is still running,
/// so that an error on the parent's side leaves no process behind.
pub struct Peer {
    child: Child,
    stdin: Option<ChildStdin>,
}

impl Peer {
    /// Starts this program as a peer with `args` after the role word.
    pub fn start(args: &[String]) -> Res<Peer> {
        let exe = std::env::current_exe().ctx("current_exe")?;
        let mut child = Command::new(exe)
            .arg(PEER_ROLE)
            .arg(rustix::process::getpid().as_raw_nonzero().to_string())
            .args(args)
            .stdin(Stdio::piped())
            .spawn()
            .ctx("starting the peer process")?;
        let stdin = child.stdin.take();
        Ok(Peer { child, stdin })
    }

    /// Tells the peer to go on (see `wait_for_go`).
    pub fn go(&mut self) -> Res<()> {
        let stdin = self.stdin.as_mut().ok_or("the peer's stdin is closed")?;
        stdin.write_all(b"g").ctx("writing to the peer")?;
        stdin.flush().ctx("writing to the peer")
    }

    /// Tells the peer that the run is over and waits for it to exit.
    pub fn finish(mut self) -> Res<()> {
        drop(self.stdin.take());
        let status = self.child.wait().ctx("waiting for the peer")?;
        if !status.success() {
            return Err(format!("the peer process failed: {status}"));
        }
        Ok(())
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        drop(self.stdin.take());
        // Nothing more can be done about errors here: the process is gone or cannot be
        // signalled, and the run is failing already.
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
    }
}

/// The peer's side, before its work: dies with the parent whose pid `parent` names, so that
/// a parent killed mid-run leaves no peer spinning or waiting.
pub fn become_peer(parent: &str) -> Res<()> {
    use rustix::process::{getppid, set_parent_process_death_signal, Signal};
    set_parent_process_death_signal(Some(Signal::KILL)).ctx("PR_SET_PDEATHSIG")?;
    // The parent may have died before the line above: then this process has been
    // re-parented already and no signal will come.
    let ppid = getppid().map(|p| p.as_raw_nonzero().to_string());
    if ppid.as_deref() != Some(parent) {
        return Err(format!("peer: parent {parent} is gone"));
    }
    Ok(())
}

/// The peer's side: waits for the parent's `Peer::go`.
pub fn wait_for_go() -> Res<()> {
    let mut b = [0u8; 1];
    std::io::stdin().read_exact(&mut b).ctx("peer: waiting for the parent")
}

/// The peer's side, after its work: waits for the parent to close our stdin.
pub fn wait_for_parent() -> Res<()> {
    let mut rest = Vec::new();
    std::io::stdin().read_to_end(&mut rest).ctx("peer: reading stdin")?;
    Ok(())
}
