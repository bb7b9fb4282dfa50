//! Named segments (file_system strategy): files `tensorshare_<root>_<pid>_<random>` in the
//! shared-memory directory (`root`: the cleanup group's founder, see `group`; `pid`: the
//! creating process), created exclusively with mode 0600.

use std::os::fd::OwnedFd;

use rustix::fs::{Mode, OFlags};
use rustix::io::Errno;

use super::shm_dir;
use crate::{Error, Result};

/// Every named segment's file name starts with this, then the creating pid and `_`.
pub(crate) const NAME_PREFIX: &str = "tensorshare_";

/// Whether `name` can be a segment name: our prefix, then letters, digits and `_` only.
/// Names come from messages, so this keeps a message from opening any other file.
pub(crate) fn is_valid_name(name: &str) -> bool {
    name.len() < 200
        && name.starts_with(NAME_PREFIX)
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
}

/// The parts of a segment's name: (group root, creating pid), or None for the group's lock
/// file and foreign names.
pub(crate) fn parse_name(name: &str) -> Option<(i32, i32)> {
    let mut parts = name.strip_prefix(NAME_PREFIX)?.split('_');
    let root = parts.next()?.parse().ok()?;
    let creator = parts.next()?.parse().ok()?;
    let random = parts.next()?;
    (random.len() == 16 && parts.next().is_none()).then_some((root, creator))
}

pub(super) fn create_exclusive() -> Result<(OwnedFd, String)> {
    let root = super::group::ensure()?;
    let pid = rustix::process::getpid().as_raw_nonzero();
    sweep_dead_creators(root, pid.get());
    for _ in 0..16 {
        let mut rnd = [0u8; 8];
        crate::util::random_bytes(&mut rnd);
        let name = format!("{NAME_PREFIX}{root}_{pid}_{:016x}", u64::from_le_bytes(rnd));
        let path = shm_dir().join(&name);
        match rustix::fs::open(
            &path,
            OFlags::RDWR | OFlags::CREATE | OFlags::EXCL | OFlags::CLOEXEC | OFlags::NOFOLLOW,
            Mode::RUSR | Mode::WUSR,
        ) {
            Ok(fd) => return Ok((fd, name)),
            Err(Errno::EXIST) => continue,
            Err(e) => return Err(Error::io(format!("creating {}", path.display()), e)),
        }
    }
    Err(Error::io("creating a named segment", std::io::Error::other("no free name after 16 tries")))
}

/// Removes the names of the group's segments whose creator has died (SIGKILL leaves them):
/// whoever still holds one keeps its memory through a descriptor, and the memory goes with
/// the last of those, while the rest of the group runs on. A creator's pid taken over by a
/// new process keeps its files until the group's cleaner removes them.
fn sweep_dead_creators(root: i32, me: i32) {
    let Ok(dir) = std::fs::read_dir(shm_dir()) else { return };
    let prefix = format!("{NAME_PREFIX}{root}_");
    for entry in dir.flatten() {
        let Ok(name) = entry.file_name().into_string() else { continue };
        if !name.starts_with(&prefix) {
            continue;
        }
        let Some((_, creator)) = parse_name(&name) else { continue };
        if creator == me {
            continue;
        }
        let Some(pid) = rustix::process::Pid::from_raw(creator) else { continue };
        if rustix::process::test_kill_process(pid) == Err(Errno::SRCH) {
            unlink(&name);
        }
    }
}

/// Removes a named segment's file; the memory lives on while anyone maps it.
pub(crate) fn unlink(name: &str) {
    let _ = rustix::fs::unlink(shm_dir().join(name));
}
