//! The receive cache (torch's SharedCache): segment identity → this process's mapping, and
//! (segment, slot) → this process's storage, both held weakly, so that memory received
//! twice, or coming back to the process that made it, is one mapping and one storage.

use std::collections::VecDeque;
use std::hash::Hash;
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use crate::arena::Arena;
use crate::shm::FileId;
use crate::storage::Inner;
use crate::Storage;

/// Entries before the first sweep of dead ones; afterwards twice the live count (torch's
/// policy: amortised O(1), and the map never holds many more dead entries than live ones).
const FIRST_LIMIT: usize = 128;
/// Arenas kept mapped after their last storage here is gone, so that a process that keeps
/// receiving from one arena does not map and unmap it for every message.
const KEEP_MAPPED: usize = 16;
/// Large arenas kept mapped that way: none larger, and at most this much in all.
const KEEP_LARGE_EACH: usize = 256 << 20;
const KEEP_LARGE_TOTAL: usize = 512 << 20;

use crate::util::FastMap;

struct WeakMap<K, V> {
    map: FastMap<K, Weak<V>>,
    limit: usize,
}

impl<K: Eq + Hash, V> WeakMap<K, V> {
    fn new() -> Self {
        WeakMap { map: FastMap::default(), limit: FIRST_LIMIT }
    }

    fn get(&self, k: &K) -> Option<Arc<V>> {
        self.map.get(k).and_then(Weak::upgrade)
    }

    fn insert(&mut self, k: K, v: &Arc<V>) {
        self.map.insert(k, Arc::downgrade(v));
        if self.map.len() > self.limit {
            self.map.retain(|_, w| w.strong_count() > 0);
            self.limit = (self.map.len() * 2).max(FIRST_LIMIT);
        }
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.map.len()
    }
}

pub(crate) struct Cache {
    arenas: WeakMap<FileId, Arena>,
    storages: WeakMap<(FileId, u32), Inner>,
    recent: VecDeque<Arc<Arena>>,
    /// Device storages by their allocation's id.
    #[cfg(feature = "cuda")]
    devices: WeakMap<crate::cuda::AllocId, Inner>,
}

impl Cache {
    /// This process's arena for a file, if it maps one (an arena inherited through fork is
    /// not this process's: a new one replaces it).
    pub(crate) fn arena(&mut self, id: FileId) -> Option<Arc<Arena>> {
        let a = self.arenas.get(&id).filter(|a| a.is_own())?;
        self.touch(&a);
        Some(a)
    }

    pub(crate) fn insert_arena(&mut self, arena: &Arc<Arena>) {
        self.arenas.insert(arena.segment().file_id(), arena);
        arena.cached.store(true, std::sync::atomic::Ordering::Relaxed);
        self.touch(arena);
    }

    /// Keeps an arena mapped for a while after its last storage here goes, so that one its
    /// creator hands out again is not mapped (and faulted in) anew. Large one-slot arenas
    /// only within bounds: none over `KEEP_LARGE_EACH`, `KEEP_LARGE_TOTAL` in all, so a
    /// dropped weight tensor's memory returns when its creator lets it go. Named ones
    /// (file_system) take room in the shared-memory filesystem, which may be small (a
    /// container's 64 MiB /dev/shm), and whose room a mapping kept here holds even once the
    /// name is gone (its creator dead): those within a sixteenth of that filesystem each
    /// and an eighth in all.
    fn touch(&mut self, arena: &Arc<Arena>) {
        if self.recent.iter().any(|a| Arc::ptr_eq(a, arena)) {
            return;
        }
        if arena.is_large() {
            let named = arena.segment().name().is_some();
            let (each, total) = if named {
                // A filesystem of no size (unlimited), or one that cannot be asked: kept by
                // the bounds of memory, as memfds are.
                let size = rustix::fs::fstatvfs(arena.segment().fd())
                    .ok()
                    .filter(|v| v.f_blocks > 0)
                    .map_or(usize::MAX, |v| {
                        usize::try_from(v.f_blocks.saturating_mul(v.f_frsize)).unwrap_or(usize::MAX)
                    });
                (KEEP_LARGE_EACH.min(size / 16), KEEP_LARGE_TOTAL.min(size / 8))
            } else {
                (KEEP_LARGE_EACH, KEEP_LARGE_TOTAL)
            };
            if arena.slot_size() > each {
                return;
            }
            // Within `KEEP_LARGE_TOTAL` in all, and named ones also within their own bound.
            let is_named = |a: &Arc<Arena>| a.segment().name().is_some();
            let sum = |f: &dyn Fn(&Arc<Arena>) -> bool| {
                self.recent.iter().filter(|a| a.is_large() && f(a)).map(|a| a.slot_size()).sum::<usize>()
            };
            let mut all = sum(&|_| true) + arena.slot_size();
            let mut of_named = sum(&is_named) + if named { arena.slot_size() } else { 0 };
            while all > KEEP_LARGE_TOTAL || of_named > total {
                // The oldest large one, a named one if those are over their bound.
                let over_named = of_named > total;
                let Some(i) = self.recent.iter().position(|a| a.is_large() && (!over_named || is_named(a)))
                else {
                    break;
                };
                if let Some(a) = self.recent.remove(i) {
                    all -= a.slot_size();
                    if is_named(&a) {
                        of_named -= a.slot_size();
                    }
                }
            }
        }
        if self.recent.len() == KEEP_MAPPED {
            self.recent.pop_front();
        }
        self.recent.push_back(arena.clone());
    }

    pub(crate) fn storage(&self, id: FileId, slot: u32) -> Option<Arc<Inner>> {
        let inner = self.storages.get(&(id, slot))?;
        // A storage inherited through fork sits on its parent's arena object.
        match Storage::from_inner(inner.clone()).shared() {
            Some(crate::storage::Shared::Slot(s)) if !s.arena().is_own() => None,
            _ => Some(inner),
        }
    }

    pub(crate) fn insert_storage(&mut self, id: FileId, slot: u32, inner: &Arc<Inner>) {
        self.storages.insert((id, slot), inner);
        inner.cached.store(true, std::sync::atomic::Ordering::Relaxed);
    }

    #[cfg(feature = "cuda")]
    pub(crate) fn device(&self, id: &crate::cuda::AllocId) -> Option<Arc<Inner>> {
        self.devices.get(id)
    }

    #[cfg(feature = "cuda")]
    pub(crate) fn insert_device(&mut self, id: crate::cuda::AllocId, inner: &Arc<Inner>) {
        self.devices.insert(id, inner);
        inner.cached.store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// Forgets the arenas kept mapped only for speed (tests and `trim`).
    pub(crate) fn clear_recent(&mut self) {
        self.recent.clear();
    }
}

/// The process's cache.
pub(crate) fn cache() -> MutexGuard<'static, Cache> {
    crate::util::lock(CACHE.get_or_make(|| {
        Mutex::new(Cache {
            arenas: WeakMap::new(),
            storages: WeakMap::new(),
            recent: VecDeque::new(),
            #[cfg(feature = "cuda")]
            devices: WeakMap::new(),
        })
    }))
}

static CACHE: crate::util::Lazy<Mutex<Cache>> = crate::util::Lazy::new();

crate::util::fork::guard_at_load!(crate::util::fork::Rank::Wire, |out| out.push(Box::new(cache())));

/// Unmaps arenas that are kept mapped only for speed, so that their memory can be returned.
pub(crate) fn release_cached_mappings() {
    cache().clear_recent();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weak_map_sweeps_dead_entries_past_its_limit() {
        let mut m: WeakMap<u32, u32> = WeakMap::new();
        let live: Vec<Arc<u32>> = (0..10).map(Arc::new).collect();
        for (i, v) in live.iter().enumerate() {
            m.insert(i as u32, v);
        }
        for i in 10..200 {
            m.insert(i, &Arc::new(i)); // dropped at once: a dead entry
        }
        assert!(m.len() < 200, "dead entries were swept");
        assert!(m.limit >= FIRST_LIMIT);
        for (i, v) in live.iter().enumerate() {
            assert!(Arc::ptr_eq(&m.get(&(i as u32)).unwrap(), v));
        }
    }
}
