//! Queues a process inherited by `fork`: whether it adopted them (see
//! `channel::adopt_forked_queues`), and the outboxes it made for them (see `Outbox::mine`).
//!
//! A forked child does not own the outbox it inherits (its parent's records, whose feeder
//! thread is not there). It writes directly, waiting for room, so that it may leave by
//! `_exit` (which drops nothing) right after a put; or, once it has promised to call
//! `flush_queues` before it leaves (`adopt_forked_queues`), it makes an outbox of its own
//! for the queue when it first puts, kept aside by the inherited one's address, and flushes
//! it when it drops the queue or when `flush_queues` asks.

use std::collections::HashMap;
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::{Arc, Mutex};

use super::outbox::Outbox;
use crate::util::lock;
use crate::util::Lazy;

/// The process that called `adopt_forked`, if any (0: none).
static ADOPTED_BY: AtomicI32 = AtomicI32::new(0);

/// See `channel::adopt_forked_queues`.
pub(crate) fn adopt_forked() {
    ADOPTED_BY.store(crate::util::fork::pid(), Ordering::SeqCst);
}

/// Whether this process adopted the queues it inherited by `fork` (a child of it has not).
pub(super) fn adopted() -> bool {
    ADOPTED_BY.load(Ordering::SeqCst) == crate::util::fork::pid()
}

/// The outboxes this process made for queues whose outbox it inherited by `fork`, by the
/// inherited outbox's address (see `Outbox::mine`).
type Forked = Mutex<HashMap<usize, Arc<Outbox>>>;

static FORKED: Lazy<Forked> = Lazy::new();

crate::util::fork::guard_at_load!(crate::util::fork::Rank::Forked, |out| out.push(Box::new(lock(forked()))));

fn forked() -> &'static Forked {
    FORKED.get_or_make(Mutex::default)
}

/// The outbox this process made in place of the inherited one at `key`, if any.
pub(super) fn mine(key: usize) -> Option<Arc<Outbox>> {
    lock(forked()).get(&key).filter(|o| o.own()).cloned()
}

/// As `mine`, made by `make` now if there is none yet.
pub(super) fn make_mine(key: usize, make: impl FnOnce() -> Outbox) -> Arc<Outbox> {
    let mut map = lock(forked());
    if let Some(o) = map.get(&key).filter(|o| o.own()) {
        return o.clone();
    }
    let fresh = Arc::new(make());
    if let Some(stale) = map.insert(key, fresh.clone()) {
        // Made by the process this one was forked from (itself a forked child): its records
        // are that process's to write, and dropping them here would let go of what they
        // hold as if they had been written.
        std::mem::forget(stale);
    }
    fresh
}

/// Takes out the outbox this process made in place of the inherited one at `key`, if any.
pub(super) fn take_mine(key: usize) -> Option<Arc<Outbox>> {
    let mut map = lock(forked());
    match map.get(&key) {
        Some(o) if o.own() => map.remove(&key),
        _ => None,
    }
}
