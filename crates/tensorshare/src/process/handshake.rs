//! How a started process knows that a tensorshare parent started it, and for what.
//!
//! A parent re-executes this program as a worker, the fork server or a shared-memory
//! cleaner, with a variable that says which (`TENSORSHARE_WORKER`,
//! `TENSORSHARE_FORKSERVER`, `TENSORSHARE_SHM_CLEANER`) and holds
//! `<descriptor>:<parent pid>:<token>`. Anyone can set a variable, so it proves nothing by
//! itself. The process takes the role only when:
//!
//! 1. descriptor 3 is an AF_UNIX SOCK_SEQPACKET socket whose peer, as the kernel recorded
//!    it when the pair was made (SO_PEERCRED), is the named parent, running as our user;
//! 2. a hello waits on it that carries the same token: 128 random bits drawn per launch.
//!    The parent queues the hello before it starts the process, so nobody waits for it: a
//!    socket with nothing queued is not a tensorshare launch, and a foreign socket cannot
//!    make the program hang;
//! 3. the hello names the parent's executable (file and GNU build-id), and it is this
//!    process's own: a worker runs code that its parent names by offsets (see `job`),
//!    which mean the same code only in the same build.
//!
//! Failing 1 or 2, the process was not started by tensorshare for that role: it writes one
//! line to stderr and goes on as the program it is (`main` runs). Past 2 it was, so it
//! never runs `main`: failing 3 it tells its parent why and exits, and a worker whose
//! parent is already gone exits. A setuid or setgid program (AT_SECURE) ignores the
//! variables.
//!
//! The hello is one record of text:
//! `tensorshare-hello/1 token=<32 hex digits> exe=<dev>:<inode>:<size>:<build-id hex or ->`,
//! with descriptors attached for the cleaner (the group's lock file).

use std::ffi::OsStr;
use std::os::fd::{AsFd, BorrowedFd, FromRawFd, OwnedFd};

use super::image::{self, ExeId};
use crate::channel::socket::{self, Received};
use crate::{Error, Result};

/// The descriptor number a re-executed process finds its socket at.
pub(crate) const INHERITED_FD: i32 = 3;

/// The first word of a hello, with the protocol's version.
const HELLO: &str = "tensorshare-hello/1";

const TOKEN_LEN: usize = 16;

/// What a started process was started for.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Role {
    Worker,
    ForkServer,
    Cleaner,
}

/// The parent's side: a launch's token, whose hello is already queued.
pub(crate) struct Invitation {
    token: [u8; TOKEN_LEN],
}

impl Invitation {
    /// Draws a token and queues the hello on `ours` with `fds` attached: call it before
    /// starting the process that will read it from the other end.
    pub(crate) fn send(ours: BorrowedFd<'_>, fds: &[BorrowedFd<'_>]) -> Result<Invitation> {
        let mut token = [0u8; TOKEN_LEN];
        let mut filled = 0;
        while filled < TOKEN_LEN {
            match rustix::rand::getrandom(&mut token[filled..], rustix::rand::GetRandomFlags::empty()) {
                Ok(n) => filled += n,
                Err(rustix::io::Errno::INTR) => {}
                Err(e) => return Err(Error::io("getrandom for a worker's token", e)),
            }
        }
        let exe = ExeId::current().map_err(Error::Unsupported)?;
        let hello = format!("{HELLO} token={} exe={}", image::hex(&token), exe.to_text());
        socket::send_record(ours, [hello.as_bytes(), &[]], fds)
            .map_err(|e| Error::io("queueing a new process's hello", e))?;
        Ok(Invitation { token })
    }

    /// The variable's value for a process started by `parent`.
    pub(crate) fn env_value(&self, parent: i32) -> String {
        format!("{INHERITED_FD}:{parent}:{}", image::hex(&self.token))
    }
}

/// A launch proven to come from a tensorshare parent.
pub(crate) struct Invited {
    /// Descriptor 3, now owned.
    pub(crate) sock: OwnedFd,
    /// The parent's pid (for a cleaner, the group's root).
    pub(crate) parent: i32,
    /// The descriptors attached to the hello.
    pub(crate) fds: Vec<OwnedFd>,
}

/// What a started process is.
pub(crate) enum Arrival {
    /// Not started by tensorshare for this role: it runs as the program it is.
    Program,
    /// Started for this role by a parent that is alive.
    Invited(Invited),
    /// Started for this role, but the parent is already gone: nobody wants the work.
    Orphaned,
    /// Started for this role by a parent it cannot work for: `reason` says why, for the
    /// parent (on `sock`) and for stderr.
    Refused { sock: OwnedFd, reason: String },
}

/// Reads `var` and decides what this process is (see the module docs). Takes `var` out of
/// the environment, so that processes this one starts do not see it.
///
/// Call it only while this process has one thread (first thing in `main`, or before it).
pub(crate) fn arrive(var: &str, role: Role) -> Arrival {
    let Some(value) = std::env::var_os(var) else { return Arrival::Program };
    std::env::remove_var(var);
    match check(&value, role, None) {
        Ok(arrival) => arrival,
        Err(why) => {
            eprintln!("tensorshare: ignoring {var} ({why}); running as a normal program");
            Arrival::Program
        }
    }
}

/// [`arrive`] for a process that may have other threads by now (one that did not call
/// `init` first and reached `spawn`): it leaves the environment as it is, and examines its
/// own copy of descriptor 3 rather than the number, which another thread could close or
/// reuse meanwhile.
pub(crate) fn arrive_late(var: &str, role: Role) -> Arrival {
    let Some(value) = std::env::var_os(var) else { return Arrival::Program };
    // SAFETY: F_DUPFD_CLOEXEC only reads the descriptor table; on a number that is not
    // open it fails with EBADF and touches nothing.
    let dup = unsafe { libc::fcntl(INHERITED_FD, libc::F_DUPFD_CLOEXEC, 0) };
    if dup == -1 {
        eprintln!("tensorshare: ignoring {var} (descriptor {INHERITED_FD} is not open)");
        return Arrival::Program;
    }
    // SAFETY: `dup` was just made by this call and nothing else knows it: it is ours.
    let copy = unsafe { OwnedFd::from_raw_fd(dup) };
    match check(&value, role, Some(copy)) {
        Ok(arrival) => arrival,
        Err(why) => {
            eprintln!("tensorshare: ignoring {var} ({why})");
            Arrival::Program
        }
    }
}

/// Checks descriptor 3, or `copy` (a copy of it made by [`arrive_late`]).
fn check(value: &OsStr, role: Role, copy: Option<OwnedFd>) -> std::result::Result<Arrival, String> {
    // SAFETY: getauxval only reads this process's auxiliary vector.
    if unsafe { libc::getauxval(libc::AT_SECURE) } != 0 {
        return Err("this program runs setuid or setgid".into());
    }
    let (parent, token) = parse_value(value).ok_or("it was not set by tensorshare")?;
    let sock = match &copy {
        Some(c) => c.as_fd(),
        // SAFETY: F_GETFD only reads the descriptor's flags; on a number that is not open
        // it fails with EBADF and touches nothing.
        None if unsafe { libc::fcntl(INHERITED_FD, libc::F_GETFD) } == -1 => {
            return Err(format!("descriptor {INHERITED_FD} is not open"))
        }
        // SAFETY: descriptor 3 is open (checked just above), and this process has one
        // thread (see `arrive`), so nothing closes it while it is borrowed; it is only
        // queried, and read once it is known to be the parent's socket.
        None => unsafe { BorrowedFd::borrow_raw(INHERITED_FD) },
    };
    socket_from(sock, parent)?;
    let record = match socket::try_recv(sock) {
        Ok(Received::Record(r)) => r,
        _ => return Err(format!("descriptor {INHERITED_FD} holds no invitation")),
    };
    let (hello_token, exe) = parse_hello(&record.bytes)
        .ok_or(format!("descriptor {INHERITED_FD} holds something other than a tensorshare hello"))?;
    if hello_token != token {
        return Err("the invitation is for another process".into());
    }
    // Proven: the parent made this socket and started this process for this role, so from
    // here on the process never runs `main`.
    let sock = match copy {
        Some(c) => c,
        // SAFETY: descriptor 3 is the socket the parent gave this process (its peer is the
        // parent and it carried this launch's token); nothing else in this process owns it.
        None => unsafe { OwnedFd::from_raw_fd(INHERITED_FD) },
    };
    let mine = match ExeId::current() {
        Ok(mine) => mine,
        Err(e) => {
            return Ok(Arrival::Refused { sock, reason: format!("cannot identify this executable: {e}") })
        }
    };
    if *mine != exe {
        let reason = format!(
            "the worker runs a different executable than its parent (the parent runs {exe}, the worker \
             {mine}): a worker runs code its parent names by offset, which is only sound in the same build"
        );
        return Ok(Arrival::Refused { sock, reason });
    }
    if role != Role::Cleaner && rustix::process::getppid().map(|p| p.as_raw_nonzero().get()) != Some(parent) {
        // A cleaner outlives its parent by design; a worker whose parent died has no job.
        return Ok(Arrival::Orphaned);
    }
    Ok(Arrival::Invited(Invited { sock, parent, fds: record.fds }))
}

/// `<fd>:<pid>:<token>`, with fd 3.
fn parse_value(value: &OsStr) -> Option<(i32, [u8; TOKEN_LEN])> {
    let mut parts = value.to_str()?.split(':');
    let fd: i32 = parts.next()?.parse().ok()?;
    let parent: i32 = parts.next()?.parse().ok()?;
    let token = image::unhex(parts.next()?)?.try_into().ok()?;
    (fd == INHERITED_FD && parent > 0 && parts.next().is_none()).then_some((parent, token))
}

/// The token and executable identity of a hello.
fn parse_hello(bytes: &[u8]) -> Option<([u8; TOKEN_LEN], ExeId)> {
    let mut words = std::str::from_utf8(bytes).ok()?.split(' ');
    if words.next()? != HELLO {
        return None;
    }
    let token = image::unhex(words.next()?.strip_prefix("token=")?)?.try_into().ok()?;
    let exe = ExeId::parse(words.next()?.strip_prefix("exe=")?)?;
    words.next().is_none().then_some((token, exe))
}

/// Whether `fd` (descriptor 3, or a copy) is an AF_UNIX SEQPACKET socket whose peer is
/// `parent` running as our user.
fn socket_from(fd: BorrowedFd<'_>, parent: i32) -> std::result::Result<(), String> {
    let not_ours = |what: String| format!("descriptor {INHERITED_FD} {what}");
    let st = rustix::fs::fstat(fd).map_err(|e| not_ours(format!("cannot be examined ({e})")))?;
    if rustix::fs::FileType::from_raw_mode(st.st_mode) != rustix::fs::FileType::Socket {
        return Err(not_ours("is not a socket".into()));
    }
    let unix = rustix::net::sockopt::socket_domain(fd).is_ok_and(|d| d == rustix::net::AddressFamily::UNIX);
    let seqpacket =
        rustix::net::sockopt::socket_type(fd).is_ok_and(|t| t == rustix::net::SocketType::SEQPACKET);
    if !unix || !seqpacket {
        return Err(not_ours("is not a local packet socket".into()));
    }
    let cred =
        rustix::net::sockopt::socket_peercred(fd).map_err(|e| not_ours(format!("has no peer ({e})")))?;
    if cred.pid.as_raw_nonzero().get() != parent || cred.uid != rustix::process::getuid() {
        return Err(not_ours(format!("was made by process {}, not by {parent}", cred.pid.as_raw_nonzero())));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_and_hellos_parse_strictly() {
        let token = "00112233445566778899aabbccddeeff";
        assert!(parse_value(OsStr::new(&format!("3:42:{token}"))).is_some());
        for bad in ["3:42", "4:42:{token}", "3:-1:{token}", "3:42:{token}:x", "3:42:0011", ""] {
            let bad = bad.replace("{token}", token);
            assert!(parse_value(OsStr::new(&bad)).is_none(), "{bad:?}");
        }
        let exe = ExeId::current().unwrap().to_text();
        assert!(parse_hello(format!("{HELLO} token={token} exe={exe}").as_bytes()).is_some());
        for bad in [
            format!("tensorshare-hello/2 token={token} exe={exe}"),
            format!("{HELLO} token={token}"),
            format!("{HELLO} token={token} exe={exe} more"),
            format!("{HELLO} token=00 exe={exe}"),
        ] {
            assert!(parse_hello(bad.as_bytes()).is_none(), "{bad:?}");
        }
    }
}
