//! The lane's windows (see the module above): which window a position is in, the first
//! one not over yet, and ending the current one early when the lane is idle.

use std::sync::atomic::Ordering;

use super::{Ring, CELLS};

impl Ring<'_> {
    /// The window of position `pos`.
    pub(crate) fn window(pos: u64) -> u64 {
        pos / CELLS
    }

    /// Ends the current window early when the ring is idle (everything claimed has been
    /// taken and is done with): its remaining positions are claimed and skipped at once,
    /// so that the window can be taken out of the directory and what it holds given back.
    /// False when there was nothing to end, or the ring was busy.
    pub(crate) fn close_window(&self) -> bool {
        let ends = self.ends();
        // Past positions done with or skipped that no consumer has passed yet (the last of
        // them may be such a one, and then no consumer ever comes to pass it).
        for _ in 0..CELLS {
            let h = ends.head.load(Ordering::Acquire);
            let d = self.cell(h).seq.load(Ordering::Acquire).wrapping_sub(h) as i64;
            let pending = ends.tail.load(Ordering::Acquire).wrapping_sub(h) as i64 > 0;
            if !pending || !(d == 2 || d >= CELLS as i64) {
                break;
            }
            let _ = ends.head.compare_exchange(h, h.wrapping_add(1), Ordering::AcqRel, Ordering::Relaxed);
        }
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
                // Lap s / CELLS is free (s ≡ 0), published (s ≡ 1) or skipped (s ≡ 2, done).
                s / CELLS + u64::from(s % CELLS == 2)
            })
            .min()
            .unwrap_or(0)
    }
}
