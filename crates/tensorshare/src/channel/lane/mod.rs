//! A queue's lane: a ring of cells in the queue's control block, which carries small
//! messages with no descriptor and no syscall while the other side is awake.
//!
//! A message fits the lane when it is at most [`CELL_BYTES`] long and its only descriptors
//! are the send descriptions of arenas of size classes (see `arena`). It then names each
//! arena by its identity (device, inode) instead of carrying a descriptor, and the ring is
//! a bounded MPMC queue of fixed cells (Dmitry Vyukov's): each cell has a sequence word,
//! `q` when it is free for position `q` (or claimed: `tail` has passed `q`), `q + 1` once
//! the message at `q` is published, `q + 2` once consumers gave up waiting for it (see
//! below; the cell is still its claimant's), and `q + CELLS` once the position is done
//! with (its message taken and held, or the position given up by its claimant), which is
//! the free state of the next lap. Producers claim positions by moving `tail`, consumers
//! take them by moving `head`.
//!
//! What holds a lane message's memory: no descriptor travels with it, so the holds ride
//! elsewhere, in the kernel as always. Positions are grouped in *windows*, one lap of the
//! ring each. Before a producer publishes a message at a position, the send description
//! of each arena it names (with the message's slots locked on it, as for any message) is
//! *parked* for that position's window: sent with `SCM_RIGHTS` into the queue's
//! directory, the otherwise unused receive queue of the socket end producers write to
//! (see `directory`). A parked description lives in that socket's buffer, whoever dies;
//! it is taken out and closed only once every position of its window has been taken and
//! done with, and a consumer is done with a position only after it holds the message's
//! slots itself: through a descriptor of the parked description, found in the directory
//! under the tag the message names and kept for the messages that follow (see
//! `queue_lane::arenas`), or, where it has none, with locks of its own. So a message is
//! held from before it is visible until its consumer holds it, whatever dies when. A
//! consumer that does not know an arena a message names finds its descriptor in the
//! directory too (a message can name only arenas parked there).
//!
//! Death in the middle of a step: a producer that dies between claiming a position and
//! publishing it would stop every consumer at that position; a consumer that finds a
//! position claimed and unpublished for [`STUCK`] skips it (`q + 2`). The cell stays its
//! claimant's: a live producer that was only stopped finishes writing it, finds its
//! publish refused, frees the cell and sends its message through the socket; a dead one
//! leaves the cell skipped, and producers find the ring full there a lap later (the queue
//! then works through its socket, as when a consumer dies in a cell). A
//! consumer that dies between taking a message and being done with it loses that message,
//! as it would lose a record it had taken off the socket, and leaves its cell in use:
//! producers then find the ring full at that cell and use the socket, and the windows from
//! that one on are never taken out of the directory, so the slots of up to two windows of
//! messages stay held until the queue is dropped.
//!
//! Peers can write any of this memory. What they can cause by it is what they could by
//! writing the arenas they were given: a message taken twice or never, a window taken out
//! early (a slot reused while a message names it). Everything read from a cell is copied
//! out and checked before use, and every loop here is bounded.

pub(super) mod directory;
mod prefetch;
mod windows;

use std::marker::PhantomData;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use crate::shm::Segment;

/// Cells in the ring; also the positions of one window.
pub(crate) const CELLS: u64 = 64;
/// Bytes of one cell, its sequence word and length included.
const CELL: usize = 4096;
/// Where a cell's message starts: right after the sequence word and the length, so that
/// a small message (one tensor's takes about 40 bytes) shares their cache line, and going
/// from the producer's CPU to the consumer's moves one line, not two.
const CELL_HEAD: usize = 16;
/// The longest message a cell carries.
pub(crate) const CELL_BYTES: usize = CELL - CELL_HEAD;
/// Where `tail` and `head` live in the control block's first page.
pub(super) const ENDS_AT: usize = 1024;
/// Where the cells start in the control block.
pub(super) const RING_AT: usize = 4096;
/// Bytes of the control block the ring takes.
pub(super) const RING_LEN: usize = CELLS as usize * CELL;
/// How long a position may stay claimed and unpublished before a consumer skips it.
pub(crate) const STUCK: Duration = Duration::from_millis(100);

#[repr(C)]
struct Ends {
    /// The next position a producer claims.
    tail: AtomicU64,
    _pad: [u8; 56],
    /// The next position a consumer takes.
    head: AtomicU64,
}

#[repr(C)]
struct CellHead {
    seq: AtomicU64,
    len: AtomicU32,
}

const _: () = assert!(ENDS_AT + std::mem::size_of::<Ends>() <= RING_AT - 64);
const _: () = assert!(CELL_BYTES % crate::atomic_bytes::WORD == 0);
const _: () =
    assert!(std::mem::size_of::<CellHead>() <= CELL_HEAD && CELL_HEAD % crate::atomic_bytes::WORD == 0);

thread_local! {
    /// The buffer of a message taken from a lane in this thread and read (see `give_back`),
    /// for the next message taken: a take allocates nothing.
    static SPARE: std::cell::Cell<Vec<u8>> = const { std::cell::Cell::new(Vec::new()) };
}

/// Whether the lane's `head` has passed position `last`: the message there was taken.
pub(crate) fn taken(head: u64, last: u64) -> bool {
    head.wrapping_sub(last) as i64 > 0
}

/// Gives back the buffer of a message taken from a lane (`Look::Took`) once it is read.
pub(crate) fn give_back(mut bytes: Vec<u8>) {
    if bytes.capacity() <= CELL_BYTES {
        bytes.clear();
        let _ = SPARE.try_with(|b| b.set(bytes));
    }
}

/// The ring inside a control block's mapping.
#[derive(Clone, Copy)]
pub(crate) struct Ring<'a> {
    base: *mut u8,
    _seg: PhantomData<&'a Segment>,
}

/// What a producer's claim found.
pub(crate) enum Claim {
    At(u64),
    /// The cell of the next position is still in use: the ring is full (or a consumer
    /// died in it).
    Full,
}

/// What a consumer's look at the ring found.
pub(crate) enum Look {
    /// The message at `pos`, copied out; the position is this consumer's until `done`.
    Took { pos: u64, bytes: std::result::Result<Vec<u8>, usize> },
    /// Nothing to take.
    Empty,
    /// `pos` is claimed (sequence word `seq`) but not published yet.
    Waiting { pos: u64, seq: u64 },
}

impl<'a> Ring<'a> {
    /// The ring of a control block.
    ///
    /// # Safety
    /// `seg` must be a control block's mapping: at least `RING_AT + RING_LEN` bytes,
    /// page-aligned.
    pub(super) unsafe fn new(seg: &'a Segment) -> Ring<'a> {
        Ring { base: seg.as_mut_ptr(), _seg: PhantomData }
    }

    /// Sets every cell free for its first position. Only on a control block nobody else
    /// has seen yet.
    pub(super) fn init(&self) {
        for i in 0..CELLS {
            self.cell(i).seq.store(i, Ordering::Relaxed);
        }
    }

    fn ends(&self) -> &'a Ends {
        // SAFETY: `new`'s contract: ENDS_AT + size_of::<Ends>() lies in the first page of
        // the mapping (asserted above), which is page-aligned, so the struct is aligned; it
        // is atomics only, valid for any bit pattern and shared by design, and the mapping
        // lives for 'a.
        unsafe { &*self.base.add(ENDS_AT).cast::<Ends>() }
    }

    fn cell_at(&self, pos: u64) -> *mut u8 {
        let i = (pos % CELLS) as usize;
        // SAFETY: `new`'s contract: RING_AT + CELLS * CELL bytes are mapped, and i < CELLS.
        unsafe { self.base.add(RING_AT + i * CELL) }
    }

    fn cell(&self, pos: u64) -> &'a CellHead {
        // SAFETY: a cell starts on a 4096-byte boundary of the mapping (aligned for the
        // struct), its head is atomics only (valid for any bit pattern, shared by design),
        // and the mapping lives for 'a.
        unsafe { &*self.cell_at(pos).cast::<CellHead>() }
    }

    pub(crate) fn head(&self) -> u64 {
        self.ends().head.load(Ordering::Acquire)
    }

    pub(crate) fn tail(&self) -> u64 {
        self.ends().tail.load(Ordering::Acquire)
    }

    /// The state of each position claimed and not taken yet, as its cell's sequence word
    /// less the position (0: being written, 1: published; see the module docs). At most a
    /// lap, whatever a peer wrote into `tail` and `head`.
    fn claimed_states(&self) -> impl Iterator<Item = u64> + '_ {
        let ends = self.ends();
        let head = ends.head.load(Ordering::SeqCst);
        let claimed = (ends.tail.load(Ordering::SeqCst).wrapping_sub(head) as i64).clamp(0, CELLS as i64);
        (0..claimed as u64)
            .map(move |i| head.wrapping_add(i))
            .map(|q| self.cell(q).seq.load(Ordering::Acquire).wrapping_sub(q))
    }

    /// How many messages wait in the lane: positions claimed and not taken yet whose message
    /// is published or being written. Positions given up (their message went through the
    /// socket, where it is counted), skipped or ended early are not counted.
    pub(crate) fn waiting(&self) -> usize {
        self.claimed_states().filter(|&d| matches!(d, 0 | 1)).count()
    }

    /// Whether a published message waits to be taken: claimed positions whose message is
    /// still being written are not counted, so a producer that died between its claim and
    /// its publish leaves no message here that never comes.
    pub(crate) fn has_published(&self) -> bool {
        self.claimed_states().any(|d| d == 1)
    }

    /// Whether nothing is claimed past what consumers have taken.
    pub(crate) fn is_empty(&self) -> bool {
        let ends = self.ends();
        let head = ends.head.load(Ordering::SeqCst);
        ends.tail.load(Ordering::SeqCst).wrapping_sub(head) as i64 <= 0
    }

    /// Asks this CPU to fetch, for writing, the lines a claim of the next position writes
    /// (`tail`, and that cell's head, where a small message lies too), without waiting for
    /// them: a put that encodes its message meanwhile then finds them its own, instead of
    /// stalling on each while the consumer's copies (which its looks leave) are taken back.
    /// Only a hint: nothing any process reads changes.
    pub(crate) fn prepare_claim(&self) {
        let t = self.ends().tail.load(Ordering::Relaxed);
        prefetch::for_write(std::ptr::from_ref(self.ends()).cast());
        prefetch::for_write(self.cell_at(t));
    }

    /// Claims the next position for a message.
    pub(crate) fn claim(&self) -> Claim {
        let tail = &self.ends().tail;
        let mut t = tail.load(Ordering::Acquire);
        // Bounded: peers moving `tail` all the time cannot keep a producer here.
        for _ in 0..4 * CELLS {
            let s = self.cell(t).seq.load(Ordering::Acquire);
            match s.wrapping_sub(t) as i64 {
                // SeqCst, as `publish`: a process that starts waiting on the socket sees a
                // claim in `is_empty`, or its claimant sees the flag (`watch_socket`).
                0 => match tail.compare_exchange_weak(
                    t,
                    t.wrapping_add(1),
                    Ordering::SeqCst,
                    Ordering::Acquire,
                ) {
                    Ok(_) => return Claim::At(t),
                    Err(now) => t = now,
                },
                d if d < 0 => return Claim::Full,
                _ => t = tail.load(Ordering::Acquire),
            }
        }
        Claim::Full
    }

    /// Writes a message into the claimed position `pos`.
    pub(crate) fn write(&self, pos: u64, bytes: &[u8]) {
        assert!(bytes.len() <= CELL_BYTES, "a lane message of {} bytes", bytes.len());
        // SAFETY: the cell's data is CELL_BYTES bytes, 16-byte aligned, inside the mapping,
        // which lives while `self` does; other processes may touch it at any time, which
        // `atomic_bytes` makes race-free on our side.
        unsafe { crate::atomic_bytes::store(self.cell_at(pos).add(CELL_HEAD), bytes) };
        self.cell(pos).len.store(bytes.len() as u32, Ordering::Relaxed);
    }

    /// Makes the message at `pos` visible. False if consumers skipped the position first
    /// (they found it claimed for too long): the cell is freed for the next lap, and the
    /// message must go another way.
    pub(crate) fn publish(&self, pos: u64) -> bool {
        let seq = &self.cell(pos).seq;
        // SeqCst: a process that starts waiting on the socket (`Queue::poll_fd`) and then
        // looks at the ring either sees this message or is seen by its producer.
        if seq.compare_exchange(pos, pos.wrapping_add(1), Ordering::SeqCst, Ordering::Relaxed).is_ok() {
            return true;
        }
        self.free_skipped(pos);
        false
    }

    /// Gives up a claimed position without a message: it is done with.
    pub(crate) fn abandon(&self, pos: u64) {
        let seq = &self.cell(pos).seq;
        if seq.compare_exchange(pos, pos.wrapping_add(CELLS), Ordering::AcqRel, Ordering::Relaxed).is_err() {
            self.free_skipped(pos);
        }
    }

    /// The claimant of a skipped position frees its cell for the next lap.
    fn free_skipped(&self, pos: u64) {
        let _ = self.cell(pos).seq.compare_exchange(
            pos.wrapping_add(2),
            pos.wrapping_add(CELLS),
            Ordering::AcqRel,
            Ordering::Relaxed,
        );
    }

    /// Takes the next message if one is published, passing positions that are done with
    /// or skipped.
    pub(crate) fn take(&self) -> Look {
        let ends = self.ends();
        for _ in 0..4 * CELLS {
            let h = ends.head.load(Ordering::Acquire);
            let cell = self.cell(h);
            let s = cell.seq.load(Ordering::Acquire);
            match s.wrapping_sub(h) as i64 {
                1 => {
                    if ends
                        .head
                        .compare_exchange(h, h.wrapping_add(1), Ordering::AcqRel, Ordering::Relaxed)
                        .is_err()
                    {
                        continue;
                    }
                    let len = cell.len.load(Ordering::Relaxed) as usize;
                    if len > CELL_BYTES {
                        return Look::Took { pos: h, bytes: Err(len) };
                    }
                    let mut bytes = SPARE.try_with(|b| b.take()).unwrap_or_default();
                    // Exactly: a buffer grown past a cell would not be kept (`give_back`).
                    bytes.reserve_exact(len);
                    bytes.resize(len, 0);
                    // SAFETY: as in `write`: len <= CELL_BYTES bytes of the cell's data.
                    unsafe { crate::atomic_bytes::load(self.cell_at(h).add(CELL_HEAD), &mut bytes) };
                    return Look::Took { pos: h, bytes: Ok(bytes) };
                }
                // Skipped, or done with (and maybe claimed again for a later lap): pass it.
                d if d == 2 || d >= CELLS as i64 => {
                    let _ =
                        ends.head.compare_exchange(h, h.wrapping_add(1), Ordering::AcqRel, Ordering::Relaxed);
                }
                _ => {
                    return if ends.tail.load(Ordering::Acquire).wrapping_sub(h) as i64 <= 0 {
                        Look::Empty
                    } else {
                        Look::Waiting { pos: h, seq: s }
                    }
                }
            }
        }
        Look::Empty
    }

    /// The consumer of `pos` is done with it (it holds what the message named, or gave the
    /// message up): the cell is free for the next lap.
    pub(crate) fn done(&self, pos: u64) {
        self.cell(pos).seq.store(pos.wrapping_add(CELLS), Ordering::Release);
    }

    /// Skips `pos`, found claimed and unpublished for too long: consumers pass it, and its
    /// cell stays its claimant's (see the module docs). Only a claimed position is skipped
    /// (`seq` must be `pos`); any other state a look reported is left alone.
    pub(crate) fn skip(&self, pos: u64, seq: u64) {
        if seq == pos {
            let _ = self.cell(pos).seq.compare_exchange(
                pos,
                pos.wrapping_add(2),
                Ordering::AcqRel,
                Ordering::Relaxed,
            );
        }
    }

    /// Writes a cell's length word as a peer could.
    #[cfg(test)]
    pub(crate) fn set_len_for_test(&self, pos: u64, len: u32) {
        self.cell(pos).len.store(len, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests;
