//! A queue's lane: a ring of cells in the queue's control block, which carries small
//! messages with no descriptor and no syscall while the other side is awake.
//!
//! A message fits the lane when it is at most [`CELL_BYTES`] long and its only descriptors
//! are the send descriptions of arenas of size classes (see `arena`). It then names each
//! arena by its identity (device, inode) instead of carrying a descriptor, and the ring is
//! a bounded MPMC queue of fixed cells (Dmitry Vyukov's): each cell has a sequence word,
//! `q` when it is free for position `q`, `q + 1` once the message at `q` is published,
//! and `q + CELLS` once that message is taken and done with (or the position was skipped),
//! which is the free state of the next lap. Producers claim positions by moving `tail`,
//! consumers take them by moving `head`.
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
//! slots itself. So a message is held from before it is visible until its consumer holds
//! it, whatever dies when. A consumer that does not know an arena a message names finds
//! its descriptor in the directory too (a message can name only arenas parked there).
//!
//! Death in the middle of a step: a producer that dies between claiming a position and
//! publishing it would stop every consumer at that position; a consumer that finds a
//! position claimed and unpublished for [`STUCK`] skips it (a live producer that was only
//! stopped then finds its position skipped and sends its message through the socket). A
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

use std::marker::PhantomData;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use crate::shm::Segment;

/// Cells in the ring; also the positions of one window.
pub(crate) const CELLS: u64 = 64;
/// Bytes of one cell, its sequence word and length included.
const CELL: usize = 4096;
/// Where a cell's message starts: its own cache line holds the sequence word and length.
const CELL_HEAD: usize = 64;
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

    /// Whether nothing is claimed past what consumers have taken.
    pub(crate) fn is_empty(&self) -> bool {
        let ends = self.ends();
        let head = ends.head.load(Ordering::SeqCst);
        ends.tail.load(Ordering::SeqCst).wrapping_sub(head) as i64 <= 0
    }

    /// Claims the next position for a message.
    pub(crate) fn claim(&self) -> Claim {
        let tail = &self.ends().tail;
        let mut t = tail.load(Ordering::Acquire);
        // Bounded: peers moving `tail` all the time cannot keep a producer here.
        for _ in 0..4 * CELLS {
            let s = self.cell(t).seq.load(Ordering::Acquire);
            match s.wrapping_sub(t) as i64 {
                0 => match tail.compare_exchange_weak(
                    t,
                    t.wrapping_add(1),
                    Ordering::AcqRel,
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
        // SAFETY: the cell's data is CELL_BYTES bytes, 64-byte aligned, inside the mapping,
        // which lives while `self` does; other processes may touch it at any time, which
        // `atomic_bytes` makes race-free on our side.
        unsafe { crate::atomic_bytes::store(self.cell_at(pos).add(CELL_HEAD), bytes) };
        self.cell(pos).len.store(bytes.len() as u32, Ordering::Relaxed);
    }

    /// Makes the message at `pos` visible. False if a consumer skipped the position first
    /// (it found it claimed for too long): the message must go another way.
    pub(crate) fn publish(&self, pos: u64) -> bool {
        // SeqCst: a process that starts waiting on the socket (`Queue::poll_fd`) and then
        // looks at the ring either sees this message or is seen by its producer.
        self.cell(pos)
            .seq
            .compare_exchange(pos, pos.wrapping_add(1), Ordering::SeqCst, Ordering::Relaxed)
            .is_ok()
    }

    /// Gives up a claimed position without a message (read as skipped).
    pub(crate) fn abandon(&self, pos: u64) {
        let _ = self.cell(pos).seq.compare_exchange(
            pos,
            pos.wrapping_add(CELLS),
            Ordering::AcqRel,
            Ordering::Relaxed,
        );
    }

    /// Takes the next message if one is published, skipping skipped positions.
    pub(crate) fn take(&self) -> Look {
        let ends = self.ends();
        for _ in 0..4 * CELLS {
            let h = ends.head.load(Ordering::Acquire);
            let cell = self.cell(h);
            let s = cell.seq.load(Ordering::Acquire);
            if s == h.wrapping_add(1) {
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
                let mut bytes = vec![0u8; len];
                // SAFETY: as in `write`: len <= CELL_BYTES bytes of the cell's data.
                unsafe { crate::atomic_bytes::load(self.cell_at(h).add(CELL_HEAD), &mut bytes) };
                return Look::Took { pos: h, bytes: Ok(bytes) };
            }
            if s == h.wrapping_add(CELLS) {
                let _ = ends.head.compare_exchange(h, h.wrapping_add(1), Ordering::AcqRel, Ordering::Relaxed);
                continue;
            }
            return if ends.tail.load(Ordering::Acquire).wrapping_sub(h) as i64 <= 0 {
                Look::Empty
            } else {
                Look::Waiting { pos: h, seq: s }
            };
        }
        Look::Empty
    }

    /// The consumer of `pos` is done with it (it holds what the message named, or gave the
    /// message up): the cell is free for the next lap.
    pub(crate) fn done(&self, pos: u64) {
        self.cell(pos).seq.store(pos.wrapping_add(CELLS), Ordering::Release);
    }

    /// Skips `pos`, found claimed with sequence word `seq` for too long.
    pub(crate) fn skip(&self, pos: u64, seq: u64) {
        let _ = self.cell(pos).seq.compare_exchange(
            seq,
            pos.wrapping_add(CELLS),
            Ordering::AcqRel,
            Ordering::Relaxed,
        );
    }

    /// Ends the current window early when the ring is idle (everything claimed has been
    /// taken and is done with): its remaining positions are claimed and skipped at once,
    /// so that the window can be taken out of the directory and what it holds given back.
    /// False when there was nothing to end, or the ring was busy.
    pub(crate) fn close_window(&self) -> bool {
        let ends = self.ends();
        let t = ends.tail.load(Ordering::Acquire);
        if t % CELLS == 0 || ends.head.load(Ordering::Acquire) != t {
            return false;
        }
        // Checked: a peer may have written any position.
        let Some(end) = (t / CELLS).checked_add(1).and_then(|w| w.checked_mul(CELLS)) else { return false };
        if (t..end).any(|q| self.cell(q).seq.load(Ordering::Acquire) != q) {
            return false;
        }
        if ends.tail.compare_exchange(t, end, Ordering::AcqRel, Ordering::Relaxed).is_err() {
            return false;
        }
        for q in t..end {
            self.cell(q).seq.store(q.wrapping_add(CELLS), Ordering::Release);
        }
        // Past the skipped positions at once (a consumer there may have moved first: it
        // then skips them one by one).
        let _ = ends.head.compare_exchange(t, end, Ordering::AcqRel, Ordering::Relaxed);
        true
    }

    /// The first window some position of which is not done with: every window before it
    /// can be taken out of the directory.
    pub(crate) fn first_open_window(&self) -> u64 {
        (0..CELLS)
            .map(|i| {
                let s = self.cell(i).seq.load(Ordering::Acquire).wrapping_sub(i);
                // Free for lap s / CELLS, or (s ≡ 1) the message of lap (s - 1) / CELLS waits.
                if s % CELLS == 0 {
                    s / CELLS
                } else {
                    s.wrapping_sub(1) / CELLS
                }
            })
            .min()
            .unwrap_or(0)
    }

    /// Writes a cell's length word as a peer could.
    #[cfg(test)]
    pub(crate) fn set_len_for_test(&self, pos: u64, len: u32) {
        self.cell(pos).len.store(len, Ordering::Relaxed);
    }

    /// The window of position `pos`.
    pub(crate) fn window(pos: u64) -> u64 {
        pos / CELLS
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::SharingStrategy;

    fn ring_segment() -> Segment {
        Segment::create(RING_AT + RING_LEN, SharingStrategy::FileDescriptor).unwrap()
    }

    #[test]
    fn messages_come_out_in_order_and_the_ring_fills_at_its_size() {
        let seg = ring_segment();
        // SAFETY: the segment is as large as a control block and page-aligned.
        let ring = unsafe { Ring::new(&seg) };
        ring.init();
        for i in 0..CELLS {
            let Claim::At(p) = ring.claim() else { panic!("full at {i}") };
            ring.write(p, &i.to_le_bytes());
            assert!(ring.publish(p));
        }
        assert!(matches!(ring.claim(), Claim::Full));
        for i in 0..CELLS {
            let Look::Took { pos, bytes } = ring.take() else { panic!("nothing at {i}") };
            assert_eq!(bytes.unwrap(), i.to_le_bytes());
            ring.done(pos);
        }
        assert!(matches!(ring.take(), Look::Empty));
        assert_eq!(ring.first_open_window(), 1);
        assert!(matches!(ring.claim(), Claim::At(p) if p == CELLS));
    }

    #[test]
    fn a_claimed_position_waits_and_a_skipped_one_is_passed_over() {
        let seg = ring_segment();
        // SAFETY: as above.
        let ring = unsafe { Ring::new(&seg) };
        ring.init();
        let Claim::At(a) = ring.claim() else { panic!() };
        let Claim::At(b) = ring.claim() else { panic!() };
        ring.write(b, b"second");
        assert!(ring.publish(b));
        let Look::Waiting { pos, seq } = ring.take() else { panic!("the first is claimed") };
        assert_eq!((pos, seq), (a, a));
        ring.skip(pos, seq);
        // The producer of `a` comes back too late: its message must go another way.
        assert!(!ring.publish(a));
        let Look::Took { pos, bytes } = ring.take() else { panic!() };
        assert_eq!((pos, bytes.unwrap()), (b, b"second".to_vec()));
        ring.done(pos);
        assert_eq!(ring.first_open_window(), 0, "the window is not over");
        assert!(ring.close_window());
        assert!(ring.is_empty());
        assert!(matches!(ring.take(), Look::Empty));
        assert_eq!(ring.first_open_window(), 1, "closed and passed");
        assert!(matches!(ring.claim(), Claim::At(p) if p == CELLS));
    }

    #[test]
    fn a_length_a_peer_wrote_past_the_cell_is_refused() {
        let seg = ring_segment();
        // SAFETY: as above.
        let ring = unsafe { Ring::new(&seg) };
        ring.init();
        let Claim::At(p) = ring.claim() else { panic!() };
        ring.write(p, b"x");
        ring.set_len_for_test(p, u32::MAX);
        assert!(ring.publish(p));
        assert!(matches!(ring.take(), Look::Took { bytes: Err(n), .. } if n == u32::MAX as usize));
    }
}
