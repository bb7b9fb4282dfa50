//! How much shared memory is left, and where named segments live.

use std::os::fd::BorrowedFd;
use std::path::{Path, PathBuf};

/// Environment variable naming the directory of named (file_system) segments; default
/// `/dev/shm`. Workers inherit it.
pub const SHM_DIR_ENV: &str = "TENSORSHARE_SHM_DIR";

/// The directory of named segments.
pub fn shm_dir() -> &'static Path {
    static DIR: crate::util::Lazy<PathBuf> = crate::util::Lazy::new();
    DIR.get_or_make(|| {
        std::env::var_os(SHM_DIR_ENV).map(PathBuf::from).unwrap_or_else(|| PathBuf::from("/dev/shm"))
    })
}

/// The size of the filesystem that holds named segments (a container's /dev/shm is 64 MiB
/// by default), or `None` where it has no size of its own or cannot be asked. Read once: a
/// process's named segments all live there.
pub(crate) fn named_room() -> Option<usize> {
    static ROOM: crate::util::Lazy<Option<usize>> = crate::util::Lazy::new();
    *ROOM.get_or_make(|| {
        let vfs = rustix::fs::statvfs(shm_dir()).ok().filter(|v| v.f_blocks > 0)?;
        Some(usize::try_from(vfs.f_blocks.saturating_mul(vfs.f_frsize)).unwrap_or(usize::MAX))
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

/// What this process's memory cgroup has left: cgroup v2 (`memory.max - memory.current`),
/// or v1 (`memory.limit_in_bytes - memory.usage_in_bytes` of the memory controller's group).
fn cgroup_memory_left() -> Option<u64> {
    let cg = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    cgroup_left(&cg, Path::new("/sys/fs/cgroup"))
}

fn cgroup_left(proc_cgroup: &str, root: &Path) -> Option<u64> {
    let read =
        |p: std::path::PathBuf| -> Option<u64> { std::fs::read_to_string(p).ok()?.trim().parse().ok() };
    // v2: "0::/path"
    if let Some(rel) = proc_cgroup.lines().find_map(|l| l.strip_prefix("0::")) {
        let dir = root.join(rel.trim_start_matches('/'));
        if let Some(max) = read(dir.join("memory.max")) {
            // "max" does not parse: no limit.
            return Some(max.saturating_sub(read(dir.join("memory.current")).unwrap_or(0)));
        }
    }
    // v1: "N:memory:/path" (or "N:cpu,memory:/path"), mounted at <root>/memory.
    let rel = proc_cgroup.lines().find_map(|l| {
        let mut parts = l.splitn(3, ':');
        let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        controllers.split(',').any(|c| c == "memory").then_some(path)
    })?;
    let base = root.join("memory");
    // Inside a container the group's own directory is usually mounted as the root.
    for dir in [base.join(rel.trim_start_matches('/')), base] {
        if let Some(limit) = read(dir.join("memory.limit_in_bytes")) {
            // An unlimited v1 group reports a huge page-rounded number: no bound worth using.
            if limit >= 1 << 62 {
                return None;
            }
            return Some(limit.saturating_sub(read(dir.join("memory.usage_in_bytes")).unwrap_or(0)));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tree(files: &[(&str, &str)]) -> std::path::PathBuf {
        let mut rnd = [0u8; 8];
        crate::util::random_bytes(&mut rnd);
        let root = std::env::temp_dir().join(format!("tensorshare-cg-{:016x}", u64::from_le_bytes(rnd)));
        for (path, text) in files {
            let p = root.join(path);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, text).unwrap();
        }
        root
    }

    #[test]
    fn cgroup_v1_and_v2_limits_are_read() {
        let v1 = tree(&[
            ("memory/job/memory.limit_in_bytes", "268435456\n"),
            ("memory/job/memory.usage_in_bytes", "67108864\n"),
        ]);
        assert_eq!(cgroup_left("5:memory:/job\n1:cpu:/x\n", &v1), Some(192 << 20));
        assert_eq!(cgroup_left("5:cpuacct,memory:/job\n", &v1), Some(192 << 20));
        let unlimited = tree(&[("memory/memory.limit_in_bytes", "9223372036854771712\n")]);
        assert_eq!(cgroup_left("4:memory:/\n", &unlimited), None);
        let v2 = tree(&[("a/memory.max", "1000\n"), ("a/memory.current", "400\n")]);
        assert_eq!(cgroup_left("0::/a\n", &v2), Some(600));
        let v2max = tree(&[("a/memory.max", "max\n"), ("a/memory.current", "400\n")]);
        assert_eq!(cgroup_left("0::/a\n", &v2max), None);
        for d in [v1, unlimited, v2, v2max] {
            std::fs::remove_dir_all(d).unwrap();
        }
    }
}
