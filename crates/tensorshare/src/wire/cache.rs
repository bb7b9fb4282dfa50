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
/// Large arenas kept mapped that way: none larger, and at most this much in all (named ones
/// are bounded by their filesystem's size too: see `touch`).
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
        if arena.segment().name().is_some() {
            // A named arena whose creator has let it go (its name removed) is never handed out
            // again, and a mapping kept here holds its room in the filesystem for nobody.
            self.recent.retain(|a| a.segment().name().is_none() || !is_unlinked(a));
        }
        self.touch(arena);
    }

    /// Keeps an arena mapped for a while after its last storage here goes, so that one its
    /// creator hands out again is not mapped (and faulted in) anew. Within bounds:
    /// - large one-slot arenas none over `KEEP_LARGE_EACH` and `KEEP_LARGE_TOTAL` in all, so
    ///   a dropped weight tensor's memory returns when its creator lets it go;
    /// - named ones (file_system), whose room in the shared-memory filesystem a mapping here
    ///   holds once their creator lets them go (or dies), and which may be small (a
    ///   container's 64 MiB /dev/shm): where it has a size, none over a 32nd of it and a
    ///   16th in all (the allocator's arenas are smaller: see `ROOM_ARENA`).
    fn touch(&mut self, arena: &Arc<Arena>) {
        if self.recent.iter().any(|a| Arc::ptr_eq(a, arena)) {
            return;
        }
        let named_room = crate::shm::named_room();
        let is_named = |a: &Arc<Arena>| named_room.is_some() && a.segment().name().is_some();
        let len = arena.segment().len();
        if arena.is_large() && arena.slot_size() > KEEP_LARGE_EACH
            || is_named(arena) && named_room.is_some_and(|room| len > room / 32)
        {
            return;
        }
        let sum = |recent: &VecDeque<Arc<Arena>>, f: &dyn Fn(&Arc<Arena>) -> bool| {
            recent.iter().filter(|a| f(a)).map(|a| a.segment().len()).sum::<usize>()
        };
        let is_large = |a: &Arc<Arena>| a.is_large();
        let mut large = sum(&self.recent, &is_large) + if arena.is_large() { len } else { 0 };
        let mut named = sum(&self.recent, &is_named) + if is_named(arena) { len } else { 0 };
        let named_total = named_room.map_or(usize::MAX, |room| room / 16);
        while large > KEEP_LARGE_TOTAL || named > named_total {
            // The oldest of those over their bound.
            let over_large = large > KEEP_LARGE_TOTAL;
            let Some(i) = self.recent.iter().position(|a| if over_large { is_large(a) } else { is_named(a) })
            else {
                break;
            };
            if let Some(a) = self.recent.remove(i) {
                if is_large(&a) {
                    large -= a.segment().len();
                }
                if is_named(&a) {
                    named -= a.segment().len();
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

/// Whether a named arena's file has been removed: its creator let it go, or died.
fn is_unlinked(arena: &Arena) -> bool {
    rustix::fs::fstat(arena.segment().fd()).is_ok_and(|st| st.st_nlink == 0)
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
