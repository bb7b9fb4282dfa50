//! The lists decoding a message needs, kept between messages on a thread.

use std::os::fd::OwnedFd;
use std::sync::Arc;

use crate::arena::Arena;
use crate::wire::header::Header;

/// What decoding a message needs besides the message, kept between messages on this
/// thread (emptied): a message of a tensor or two would otherwise allocate each list and
/// free it.
#[derive(Default)]
pub(super) struct Lists {
    pub(super) header: Header,
    /// Per segment of the message: its arena, and the description that holds its slots.
    pub(super) arenas: Vec<Arc<Arena>>,
    pub(super) carried: Vec<Option<Arc<OwnedFd>>>,
    /// Slots not held here yet: (segment, slot, length, entry naming it).
    pub(super) new: Vec<(u32, u32, usize, usize)>,
    pub(super) slots: Vec<u32>,
}

thread_local! {
    static LISTS: std::cell::RefCell<Lists> = std::cell::RefCell::default();
}

/// Most entries a kept list may have room for.
const ROOM: usize = 1024;

impl Lists {
    /// Runs `f` with this thread's lists (new empty ones if a decode under way in this
    /// thread has them), used in place and emptied afterwards, also when `f` panics.
    pub(super) fn with<R>(f: impl FnOnce(&mut Lists) -> R) -> R {
        struct Emptied<'a>(std::cell::RefMut<'a, Lists>);
        impl Drop for Emptied<'_> {
            fn drop(&mut self) {
                self.0.empty();
            }
        }
        LISTS.with(|l| match l.try_borrow_mut() {
            Ok(kept) => f(&mut Emptied(kept).0),
            Err(_) => f(&mut Lists::default()),
        })
    }

    /// Empties the lists for the next message, and lets them go if one has grown large.
    fn empty(&mut self) {
        let rooms = [
            self.header.segments.capacity(),
            self.header.storages.capacity(),
            self.arenas.capacity(),
            self.carried.capacity(),
            self.new.capacity(),
            self.slots.capacity(),
        ];
        if rooms.into_iter().any(|c| c > ROOM) {
            *self = Lists::default();
            return;
        }
        self.header.segments.clear();
        self.header.storages.clear();
        self.arenas.clear();
        self.carried.clear();
        self.new.clear();
        self.slots.clear();
    }
}
