//! `tensorshare shm ls` and `tensorshare shm gc`.

use crate::info::human;

pub fn ls() -> Result<(), String> {
    let segments = tensorshare::segments::list().map_err(|e| e.to_string())?;
    let dir = tensorshare::segments::shm_dir();
    if segments.is_empty() {
        println!("no tensorshare segments of this user in {}", dir.display());
        return Ok(());
    }
    println!("{:<56} {:>10} {:>8} {:>10}  group", "name", "size", "creator", "root");
    for s in &segments {
        let creator = s.creator.map_or_else(|| "-".to_string(), |c| c.to_string());
        let state = if s.group_alive { "alive" } else { "dead (shm gc removes it)" };
        println!("{:<56} {:>10} {:>8} {:>10}  {state}", s.name, human(s.size), creator, s.root);
    }
    Ok(())
}

pub fn gc(dry_run: bool) -> Result<(), String> {
    let removed = tensorshare::segments::gc(dry_run).map_err(|e| e.to_string())?;
    let verb = if dry_run { "would remove" } else { "removed" };
    for name in &removed {
        println!("{verb} {name}");
    }
    println!("{verb} {} file(s) of dead groups", removed.len());
    Ok(())
}
