//! Send descriptions: the description a message from this process carries, with the
//! message's slots locked on it (see the module above).

use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;

use super::locks::{lock_range, runs};
use super::{borrow, Arena, SendHold, State, CHECK_RUN, SEND_BATCH, SEND_SLOTS};
use crate::{Error, Result};

impl Arena {
    /// The description a message naming `slots` of this arena carries, with each slot
    /// locked on it, and its tag: a random number, never 0, that names this description
    /// among those parked in a queue's lane directory (see `channel::lane`), so that a lane
    /// message's receiver can borrow the holds as a socket message's receiver does; 0 for a
    /// description this process borrowed, which its receivers then do not borrow. The
    /// caller holds a handle of each slot.
    pub(crate) fn send_hold(self: &Arc<Self>, slots: &[u32]) -> Result<(Arc<OwnedFd>, u64)> {
        if !self.is_own() {
            // Inherited through fork: the record is the parent's (and may be locked for good,
            // by a thread the child lacks). The caller's handles are held by the fork hold
            // its parent made for it (see `fork_hold`), whose description has every slot
            // the child has a handle of locked on it: the message carries it, and holds its
            // slots through it whatever the child does next; every message from the arena
            // shares it, so a backlog of them keeps one descriptor open, not one each.
            // Borrowed by no receiver (tag 0).
            if let Some(fd) = self.fork_hold.for_message() {
                return Ok((fd, 0));
            }
            // No fork hold (it could not be made, or its cell is busy): a description of
            // the message's own.
            let fd = self.seg.reopen()?;
            let mut need = slots.to_vec();
            for (start, len) in runs(&mut need) {
                lock_range(fd.as_fd(), start, len, libc::F_RDLCK)
                    .map_err(|e| Error::io("locking inherited slots for a message (F_OFD_SETLK)", e))?;
            }
            return Ok((Arc::new(fd), 0));
        }
        let mut st = self.state();
        if let Some(via) = forwarded(&st, slots) {
            // Slots this process holds through the description of the message that brought
            // them: that description holds them all, and nobody unlocks it. It goes on.
            return Ok((via, 0));
        }
        if st.send.as_ref().is_some_and(|s| s.messages >= SEND_BATCH || s.nlocked >= SEND_SLOTS) {
            st.send = None;
        }
        if st.send.is_none() {
            let n = self.nslots as usize;
            let fd = match st.spare.take() {
                Some(fd) => fd,
                None => self.seg.reopen()?,
            };
            borrow::note_spare_wanted(self);
            st.send = Some(SendHold {
                fd: Arc::new(fd),
                locked: vec![false; n],
                sent: vec![false; n],
                nlocked: 0,
                messages: 0,
                tag: random_tag(),
            });
        }
        let st = &mut *st;
        let send = st.send.as_mut().expect("set above");
        let mut need: Vec<u32> = slots.iter().copied().filter(|&s| !send.locked[s as usize]).collect();
        for (start, len) in runs(&mut need) {
            // The creator locks ahead: the slots after these are the ones it hands out next.
            let len = if self.creator { len.max(CHECK_RUN).min(self.nslots - start) } else { len };
            lock_range(send.fd.as_fd(), start, len, libc::F_RDLCK)
                .map_err(|e| Error::io("locking slots for a message (F_OFD_SETLK)", e))?;
            for l in &mut send.locked[start as usize..(start + len) as usize] {
                send.nlocked += usize::from(!*l);
                *l = true;
            }
        }
        for &slot in slots {
            send.sent[slot as usize] = true;
            if self.creator {
                st.exposed[slot as usize] = true;
            }
        }
        send.messages += 1;
        Ok((send.fd.clone(), send.tag))
    }
}

/// A random number that is not 0.
fn random_tag() -> u64 {
    let mut b = [0u8; 8];
    crate::util::random_bytes(&mut b);
    u64::from_le_bytes(b) | 1
}

/// The one borrowed description through which this process holds all of `slots`, if any.
fn forwarded(st: &State, slots: &[u32]) -> Option<Arc<OwnedFd>> {
    let first = st.borrowed.get(*slots.first()? as usize)?.as_ref()?;
    slots
        .iter()
        .all(|&s| st.borrowed.get(s as usize).and_then(Option::as_ref).is_some_and(|f| Arc::ptr_eq(f, first)))
        .then(|| first.clone())
}
