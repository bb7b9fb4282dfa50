//! Large copies into shared memory that bypass this core's caches.
//!
//! Moving a large buffer into an arena (a tensor a program made in private memory, then sent)
//! writes memory that another process reads next, not this one. Ordinary stores first read
//! every destination line into this core's cache and then push out of it what the process
//! was using (its interpreter, its other tensors); non-temporal stores write whole lines
//! straight to memory, and leave the caches to the process's own work.
//!
//! Each word is still written by one aligned 8-byte store instruction (`MOVNTI`), which
//! x86-64 performs atomically as it does a relaxed atomic store, so the module's rule holds: every access
//! to storage bytes is an aligned whole-word atomic one. Non-temporal stores are weakly
//! ordered; the `SFENCE` that ends the copy orders them before every later store of this
//! thread, as a release fence would, so a handle published after the copy (a message sent,
//! a lock let go) shows its bytes.

/// Copies whose aligned words come to at least this many bytes take non-temporal stores;
/// smaller ones are read back soon enough (often by this process) that caching them pays.
/// A large one that this process reads next (a model's weights after `share_memory_()`)
/// reads it from memory, not from its caches, once.
pub(crate) const STREAM_MIN: usize = 256 << 10;

/// Words written per turn of the loop: 64 bytes, one whole line where `dst` starts on a
/// line (a storage's bytes do, and the copies into them start there), which then leaves the
/// write-combining buffer at once.
const LINE_WORDS: usize = 8;

/// Copies as many whole lines of words as fit in `words` words from `src` to `dst`, both
/// 8-byte aligned, with non-temporal stores, and returns how many words it copied (a
/// multiple of [`LINE_WORDS`]; 0 where the target has no such stores). `src` is read with
/// aligned 8-byte loads, which take any bit pattern.
///
/// # Safety
/// `src..src + 8 * words` must be readable for the call (its writers, if any, give torn
/// bytes as with volatile loads); `dst..dst + 8 * words` must lie in one host storage's
/// bytes, which live for the call; both are 8-byte aligned and do not overlap.
#[cfg(all(target_arch = "x86_64", not(miri)))]
pub(crate) unsafe fn stream_words(src: *const u64, dst: *mut u64, words: usize) -> usize {
    let lines = words / LINE_WORDS;
    if lines == 0 {
        return 0;
    }
    // SAFETY: the loop reads `lines` 64-byte lines from `src` and writes as many to `dst`,
    // which lie within the ranges the caller vouched for (`lines * 8 <= words`), with one
    // aligned 8-byte load (`MOV`) and one aligned 8-byte store (`MOVNTI`, SSE2, part of the
    // x86-64 baseline) per word: the accesses a relaxed atomic copy makes, so they race with
    // no other handle's whole-word atomic accesses (module docs), and a writer of `src`
    // outside them gives torn bytes only. The `SFENCE` orders the stores before what
    // follows. Only the named registers and the flags change, and the stack is not
    // touched (`nostack`).
    unsafe {
        std::arch::asm!(
            "2:",
            "mov {t}, qword ptr [{s}]",
            "movnti qword ptr [{d}], {t}",
            "mov {t}, qword ptr [{s} + 8]",
            "movnti qword ptr [{d} + 8], {t}",
            "mov {t}, qword ptr [{s} + 16]",
            "movnti qword ptr [{d} + 16], {t}",
            "mov {t}, qword ptr [{s} + 24]",
            "movnti qword ptr [{d} + 24], {t}",
            "mov {t}, qword ptr [{s} + 32]",
            "movnti qword ptr [{d} + 32], {t}",
            "mov {t}, qword ptr [{s} + 40]",
            "movnti qword ptr [{d} + 40], {t}",
            "mov {t}, qword ptr [{s} + 48]",
            "movnti qword ptr [{d} + 48], {t}",
            "mov {t}, qword ptr [{s} + 56]",
            "movnti qword ptr [{d} + 56], {t}",
            "add {s}, 64",
            "add {d}, 64",
            "sub {n}, 1",
            "jnz 2b",
            "sfence",
            s = inout(reg) src => _,
            d = inout(reg) dst => _,
            n = inout(reg) lines => _,
            t = out(reg) _,
            options(nostack),
        );
    }
    lines * LINE_WORDS
}

/// Elsewhere (and under Miri, which runs no assembly): no non-temporal stores; the caller
/// copies every word itself.
///
/// # Safety
/// None needed; `unsafe` to match the x86-64 version.
#[cfg(not(all(target_arch = "x86_64", not(miri))))]
pub(crate) unsafe fn stream_words(_src: *const u64, _dst: *mut u64, _words: usize) -> usize {
    0
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::atomic_bytes::store_from_volatile;

    #[repr(C, align(64))]
    #[derive(Clone, Copy)]
    struct Line([u8; 64]);

    #[test]
    fn large_copies_land_whole_and_leave_neighbours_alone() {
        // Lengths past the threshold that end inside a line, on a line and inside a word,
        // from sources aligned alike and unlike the destination.
        const N: usize = (2 * STREAM_MIN) / 64 + 4;
        let mut backing = vec![Line([0; 64]); N];
        for (i, b) in backing.iter_mut().flat_map(|b| b.0.iter_mut()).enumerate() {
            *b = (i * 31 + i / 251) as u8;
        }
        // SAFETY: the initialised bytes of the 64-byte aligned `backing`, which outlives it.
        let src = unsafe { std::slice::from_raw_parts(backing.as_ptr().cast::<u8>(), N * 64) };
        let cases = [
            (0, 0, STREAM_MIN),
            (8, 0, STREAM_MIN + 8 * 5),
            (3, 3, 2 * STREAM_MIN - 13),
            (16, 40, STREAM_MIN + 64 * 3 + 1),
            (1, 6, STREAM_MIN + 100),
        ];
        for (s_off, d_off, len) in cases {
            let mut dst = vec![Line([0xAA; 64]); N];
            let d = dst.as_mut_ptr().cast::<u8>();
            // SAFETY: `src[s_off..s_off + len]` is readable; `d_off + len` bytes fit in the
            // N * 64-byte, 64-byte aligned destination, which does not overlap it.
            unsafe { store_from_volatile(src.as_ptr().add(s_off), d.add(d_off), len) };
            // SAFETY: the destination's N * 64 initialised bytes, read after the copy.
            let out = unsafe { std::slice::from_raw_parts(d, N * 64) };
            assert!(out[d_off..d_off + len] == src[s_off..s_off + len], "{s_off} {d_off} {len}");
            assert!(out[..d_off].iter().chain(&out[d_off + len..]).all(|&b| b == 0xAA));
        }
    }

    #[test]
    fn whole_lines_are_streamed_and_the_rest_left_to_the_caller() {
        let src: Vec<u64> = (0..37).collect();
        let mut dst = vec![0u64; 37];
        // SAFETY: both vectors hold 37 aligned words, live for the call and do not overlap;
        // nothing else touches `dst` meanwhile.
        let done = unsafe { stream_words(src.as_ptr(), dst.as_mut_ptr(), 37) };
        if cfg!(all(target_arch = "x86_64", not(miri))) {
            assert_eq!(done, 32);
        } else {
            assert_eq!(done, 0);
        }
        assert_eq!(dst[..done], src[..done]);
        assert!(dst[done..].iter().all(|&w| w == 0));
        // SAFETY: as above, with fewer words than a line.
        assert_eq!(unsafe { stream_words(src.as_ptr(), dst.as_mut_ptr(), 7) }, 0);
    }
}
