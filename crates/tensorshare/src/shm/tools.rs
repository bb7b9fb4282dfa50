//! What `tensorshare shm ls` and `shm gc` show and do: this user's named segments, whether
//! their group is alive, and the removal of those whose group is gone.

use std::os::unix::fs::MetadataExt;

use super::group::{group_alive, open_lock, remove_group, remove_if_dead};
use super::{shm_dir, NAME_PREFIX};
use crate::{Error, Result};

/// One file of tensorshare's in the shared-memory directory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SegmentInfo {
    /// File name.
    pub name: String,
    /// Size in bytes.
    pub size: u64,
    /// The cleanup group's root: its founder's pid, or a number above any pid (see the module).
    pub root: i32,
    /// The creating process (None for the group's lock file).
    pub creator: Option<i32>,
    /// Whether any process of the group is alive.
    pub group_alive: bool,
}

/// This user's tensorshare files in the shared-memory directory, by name.
pub fn list() -> Result<Vec<SegmentInfo>> {
    let dir = shm_dir();
    let uid = rustix::process::geteuid().as_raw();
    let mut alive = std::collections::HashMap::new();
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(|e| Error::io(format!("listing {}", dir.display()), e))? {
        let Ok(entry) = entry else { continue };
        let Ok(name) = entry.file_name().into_string() else { continue };
        let Some(rest) = name.strip_prefix(NAME_PREFIX) else { continue };
        let Some(root) = rest.split('_').next().and_then(|r| r.parse::<i32>().ok()) else { continue };
        let Ok(meta) = entry.metadata() else { continue };
        if meta.uid() != uid {
            continue;
        }
        let creator = super::parse_name(&name).map(|(_, c)| c);
        let group_alive = *alive.entry(root).or_insert_with(|| group_alive(root));
        out.push(SegmentInfo { name, size: meta.len(), root, creator, group_alive });
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}

/// Removes (or, with `dry_run`, only lists) every file of this user's groups that have no
/// live process left. Returns the names.
pub fn gc(dry_run: bool) -> Result<Vec<String>> {
    let mut dead: Vec<i32> = list()?.into_iter().filter(|s| !s.group_alive).map(|s| s.root).collect();
    dead.sort();
    dead.dedup();
    let mut removed = Vec::new();
    for root in dead {
        if dry_run {
            if !group_alive(root) {
                removed.extend(remove_group(root, true)?);
            }
        } else if open_lock(root).is_ok() {
            // Under the group's exclusive lock, if it is still free and still that file.
            removed.extend(remove_if_dead(root)?);
        } else if !group_alive(root) {
            // Files without a lock file (planted, or left by a removal cut short).
            removed.extend(remove_group(root, false)?);
        }
    }
    Ok(removed)
}
