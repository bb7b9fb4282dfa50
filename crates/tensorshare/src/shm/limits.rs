//! How much shared memory is left, and where named segments live.

use std::os::fd::BorrowedFd;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// Environment variable naming the directory of named (file_system) segments; default
/// `/dev/shm`. Workers inherit it.
pub const SHM_DIR_ENV: &str = "TENSORSHARE_SHM_DIR";

/// The directory of named segments.
pub fn shm_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        std::env::var_os(SHM_DIR_ENV).map(PathBuf::from).unwrap_or_else(|| PathBuf::from("/dev/shm"))
    })
}

/// Bytes that a new reservation can still take: the free space of the filesystem that
/// holds `fd` (when it has a size limit), bounded by the memory the system and this
/// process's cgroup have left.
pub fn available_bytes(fd: Option<BorrowedFd<'_>>) -> u64 {
    let mut avail = memory_available();
    if let Some(fd) = fd {
        if let Ok(vfs) = rustix::fs::fstatvfs(fd) {
            // The kernel's own memfd mount reports no blocks: it has no size of its own.
            if vfs.f_blocks > 0 {
                avail = avail.min(vfs.f_bavail.saturating_mul(vfs.f_frsize));
            }
        }
    }
    avail
}

/// MemAvailable, or what the cgroup's memory.max leaves, whichever is smaller.
fn memory_available() -> u64 {
    let mut avail = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("MemAvailable:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .map(|kb| kb * 1024)
        .unwrap_or(u64::MAX);
    if let Some(left) = cgroup_memory_left() {
        avail = avail.min(left);
    }
    avail
}

fn cgroup_memory_left() -> Option<u64> {
    let cg = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let rel = cg.lines().find_map(|l| l.strip_prefix("0::"))?;
    let dir = Path::new("/sys/fs/cgroup").join(rel.trim_start_matches('/'));
    let max = std::fs::read_to_string(dir.join("memory.max")).ok()?;
    let max: u64 = max.trim().parse().ok()?; // "max" means no limit
    let cur: u64 = std::fs::read_to_string(dir.join("memory.current")).ok()?.trim().parse().ok()?;
    Some(max.saturating_sub(cur))
}
