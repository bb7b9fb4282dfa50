//! Race-free copies in and out of host memory that other handles may touch at the same
//! time.
//!
//! A storage's bytes can be reached through many handles at once: clones and views in this
//! process, on any thread, and every process the storage was sent to. The safe functions of
//! this crate that read or write those bytes (`to_vec`, `to_bytes`, `fill`,
//! `copy_from_slice`, `copy_into`, the atomic view, a storage's `to_bytes`) all go through
//! this module, and it touches memory only with relaxed atomic operations on aligned 8-byte
//! words: a load, a store of a whole word, or a compare-exchange that replaces part of a
//! word. So two safe accesses of the same bytes are never a data race, and never atomic
//! accesses of different sizes (which the Rust memory model leaves undefined as well),
//! whatever dtypes their views have. Large copies of outside memory into a storage (see
//! `streamed`) store their words with non-temporal instructions in assembly: each is one
//! aligned 8-byte store, atomic as a relaxed store is, and a fence orders them before what
//! follows, so the rule holds for them too. A write from another process is outside the Rust
//! memory model; at worst it gives torn values (a word is never torn, and no element spans
//! two words), which readers validate where not every bit pattern is valid (`bool`).
//!
//! This rests on one property of every host storage (see [`crate::Storage`]): its memory
//! comes in whole 64-byte chunks, 64-byte aligned (a private buffer, or an arena slot in a
//! page-aligned mapping), so the aligned word around any of its bytes lies in the same
//! allocation or mapping.
//!
//! Zero-copy borrows (`as_slice`, `as_mut_slice`, `view`, `view_mut`) are plain references
//! and are `unsafe`: their callers promise that nothing else accesses the bytes meanwhile.

use std::sync::atomic::{AtomicU64, Ordering};

#[path = "atomic_bytes/streamed.rs"]
mod streamed;

/// The unit of every access.
pub(crate) const WORD: usize = 8;

/// The word around `p` and the position of `p` in it.
///
/// # Safety
/// `p` must point into (or one past the end of) a host storage's bytes (see the module
/// docs), so that the aligned word around it lies in the storage's allocation, which lives
/// for `'a`.
unsafe fn word_of<'a>(p: *const u8) -> (&'a AtomicU64, usize) {
    let at = p as usize % WORD;
    // SAFETY: the aligned word around `p` starts `at` bytes before it, inside the same
    // allocation (the caller's contract), so the subtraction stays in bounds.
    let w = unsafe { p.sub(at) }.cast::<u64>().cast_mut();
    // SAFETY: `w` is 8-byte aligned (AtomicU64's alignment on every target with 64-bit
    // atomics), valid for reads and writes for `'a` (the caller's contract: the mapping or
    // heap buffer is writable and outlives 'a), and this crate's safe code accesses it only
    // through whole-word atomics (module docs); non-atomic access is left to the callers of
    // the `unsafe` borrows, whose contract excludes it.
    (unsafe { AtomicU64::from_ptr(w) }, at)
}

/// Splits a range of `len` bytes starting at address `p` into a head that ends at the next
/// word boundary (or the range's end), whole words, and a tail.
fn split(p: usize, len: usize) -> (usize, usize, usize) {
    let head = ((WORD - p % WORD) % WORD).min(len);
    let body = (len - head) / WORD * WORD;
    (head, body, len - head - body)
}

/// Copies `dst.len()` bytes starting at `src` into `dst`.
///
/// # Safety
/// `src..src + dst.len()` must lie in one host storage's bytes, which live for the call.
pub(crate) unsafe fn load(src: *const u8, dst: &mut [u8]) {
    let (head, body, _) = split(src as usize, dst.len());
    let (head_dst, rest) = dst.split_at_mut(head);
    let (body_dst, tail_dst) = rest.split_at_mut(body);
    // SAFETY: the three parts cover src..src + dst.len(), in the storage (the caller's
    // contract); the head and the tail each lie in one word, the body starts on a word.
    unsafe {
        load_in_word(src, head_dst);
        let words = src.add(head).cast::<u64>();
        for (k, out) in body_dst.chunks_exact_mut(WORD).enumerate() {
            let (word, _) = word_of(words.add(k).cast());
            out.copy_from_slice(&word.load(Ordering::Relaxed).to_ne_bytes());
        }
        load_in_word(src.add(head + body), tail_dst);
    }
}

/// `load` of a range that lies in one word (possibly empty).
///
/// # Safety
/// As `load`.
unsafe fn load_in_word(src: *const u8, dst: &mut [u8]) {
    if dst.is_empty() {
        return;
    }
    // SAFETY: src is in a storage, the caller's contract.
    let (word, at) = unsafe { word_of(src) };
    dst.copy_from_slice(&word.load(Ordering::Relaxed).to_ne_bytes()[at..at + dst.len()]);
}

/// Copies `src` to the bytes starting at `dst`. Bytes of a word outside `dst..dst + len`
/// keep whatever value they have, even if another thread writes them meanwhile.
///
/// # Safety
/// `dst..dst + src.len()` must lie in one host storage's bytes, which live for the call.
pub(crate) unsafe fn store(dst: *mut u8, src: &[u8]) {
    let (head, body, _) = split(dst as usize, src.len());
    let (head_src, rest) = src.split_at(head);
    let (body_src, tail_src) = rest.split_at(body);
    // SAFETY: the three parts cover dst..dst + src.len(), in the storage (the caller's
    // contract); the head and the tail each lie in one word, the body starts on a word.
    unsafe {
        store_in_word(dst, head_src);
        let words = dst.add(head).cast::<u64>();
        for (k, part) in body_src.chunks_exact(WORD).enumerate() {
            let (word, _) = word_of(words.add(k).cast());
            let mut bytes = [0u8; WORD];
            bytes.copy_from_slice(part);
            word.store(u64::from_ne_bytes(bytes), Ordering::Relaxed);
        }
        store_in_word(dst.add(head + body), tail_src);
    }
}

/// Writes `len` bytes at `dst` with the 8-byte pattern `word`, byte `k` of it at every
/// address equal to `k` modulo 8: a fill of elements whose size divides 8, in storage
/// memory (aligned to 8), is one such pattern. The words in between are one relaxed store
/// each, in a tight loop; the partial words at both ends keep their other bytes.
///
/// # Safety
/// As `store`: `dst..dst + len` must lie in one host storage's bytes, which live for the
/// call.
pub(crate) unsafe fn fill(dst: *mut u8, len: usize, word: [u8; WORD]) {
    let (head, body, tail) = split(dst as usize, len);
    let at = dst as usize % WORD;
    let value = u64::from_ne_bytes(word);
    // SAFETY: the three parts cover dst..dst + len, in the storage (the caller's contract);
    // the head lies in the word of `dst` from byte `at` on (at + head <= WORD), the body
    // starts on a word boundary and holds body / WORD whole words, the tail lies in one word.
    unsafe {
        store_in_word(dst, &word[at..at + head]);
        let words = dst.add(head).cast::<u64>();
        for k in 0..body / WORD {
            AtomicU64::from_ptr(words.add(k)).store(value, Ordering::Relaxed);
        }
        store_in_word(dst.add(head + body), &word[..tail]);
    }
}

/// `store` of a range that lies in one word (possibly empty): a compare-exchange, so that
/// concurrent writes of the word's other bytes are kept.
///
/// # Safety
/// As `store`.
unsafe fn store_in_word(dst: *mut u8, src: &[u8]) {
    if src.is_empty() {
        return;
    }
    // SAFETY: dst is in a storage, the caller's contract.
    let (word, at) = unsafe { word_of(dst) };
    replace(word, at, src.len(), |bytes| bytes.copy_from_slice(src));
}

/// Copies `len` bytes from `src` to `dst`, through a private buffer a chunk at a time.
///
/// # Safety
/// Both ranges must each lie in one host storage's bytes, which live for the call, and
/// must not overlap.
pub(crate) unsafe fn copy(src: *const u8, dst: *mut u8, len: usize) {
    let mut buf = [0u8; 4096];
    let mut done = 0;
    while done < len {
        let n = buf.len().min(len - done);
        // SAFETY: src + done .. + n and dst + done .. + n lie in the ranges the caller
        // vouched for.
        unsafe {
            load(src.add(done), &mut buf[..n]);
            store(dst.add(done), &buf[..n]);
        }
        done += n;
    }
}

/// Copies `len` bytes from `src`, memory outside every storage that other code may write
/// meanwhile, to `dst`, written as [`store`] writes. `src` is read with volatile loads of
/// plain integers, which accept any bit pattern: aligned words where `src` and `dst` are
/// aligned alike (the common case: both allocators align to 64 bytes), single bytes
/// elsewhere, so that no load leaves `src..src + len`. A write racing with the read leaves
/// torn bytes, as any copy of such memory would.
///
/// # Safety
/// `src..src + len` must be readable for the call; `dst..dst + len` must lie in one host
/// storage's bytes, which live for the call; the ranges must not overlap.
pub(crate) unsafe fn store_from_volatile(src: *const u8, dst: *mut u8, len: usize) {
    if src as usize % WORD != dst as usize % WORD {
        // Through a private buffer a chunk at a time, `src` read in its own aligned words.
        let mut buf = [0u8; 4096];
        let mut done = 0;
        while done < len {
            let n = buf.len().min(len - done);
            let (head, body, tail) = split(src as usize + done, n);
            // SAFETY: src + done .. + n lies in the range the caller vouched for; its head
            // and tail are read byte by byte, its body in whole words, aligned (it starts on
            // a word boundary of `src`'s addresses), written unaligned into `buf`; dst + done
            // .. + n lies in the storage range the caller vouched for.
            unsafe {
                let s = src.add(done);
                for k in (0..head).chain(head + body..head + body + tail) {
                    buf[k] = s.add(k).read_volatile();
                }
                for k in (head..head + body).step_by(WORD) {
                    let w = s.add(k).cast::<u64>().read_volatile();
                    buf[k..k + WORD].copy_from_slice(&w.to_ne_bytes());
                }
                store(dst.add(done), &buf[..n]);
            }
            done += n;
        }
        return;
    }
    let (head, body, tail) = split(dst as usize, len);
    let mut bytes = [0u8; WORD];
    // SAFETY: the head, the words and the tail cover the two ranges the caller vouched for,
    // at the same offsets; `src + head` is 8-byte aligned as `dst + head` is (the two are
    // equal modulo 8), so every whole word is read aligned and lies in `src..src + len`
    // (those `stream_words` copies, at most `body / WORD`, are the first ones, which it
    // takes from and writes to the same aligned ranges); the head and the tail are read byte
    // by byte and each lies in one word of `dst`.
    unsafe {
        for (k, b) in bytes[..head].iter_mut().enumerate() {
            *b = src.add(k).read_volatile();
        }
        store_in_word(dst, &bytes[..head]);
        // A large copy goes straight to memory a line at a time (see `streamed`); the words
        // it leaves are copied below.
        let streamed = if body >= streamed::STREAM_MIN {
            streamed::stream_words(src.add(head).cast(), dst.add(head).cast(), body / WORD)
        } else {
            0
        };
        for k in streamed..body / WORD {
            let w = src.add(head + k * WORD).cast::<u64>().read_volatile();
            AtomicU64::from_ptr(dst.add(head + k * WORD).cast::<u64>()).store(w, Ordering::Relaxed);
        }
        for (k, b) in bytes[..tail].iter_mut().enumerate() {
            *b = src.add(head + body + k).read_volatile();
        }
        store_in_word(dst.add(head + body), &bytes[..tail]);
    }
}

/// Atomically applies `f` to the `n` bytes at `p`, which lie in one word, and returns what
/// they were before. `f` may run several times (when another thread changes the word
/// meanwhile); its last run is the one that counts.
///
/// # Safety
/// `p..p + n` must lie in one host storage's bytes, which live for the call, and in one
/// aligned word (`p as usize % 8 + n <= 8`).
pub(crate) unsafe fn update(p: *mut u8, n: usize, f: impl FnMut(&mut [u8])) -> [u8; WORD] {
    // SAFETY: p is in a storage, the caller's contract.
    let (word, at) = unsafe { word_of(p) };
    debug_assert!(at + n <= WORD);
    let old = replace(word, at, n, f);
    let mut out = [0u8; WORD];
    out[..n].copy_from_slice(&old[at..at + n]);
    out
}

/// Replaces bytes `at..at + n` of `word` with what `f` makes of them, in one
/// compare-exchange (retried while other bytes of the word change); returns the old word.
fn replace(word: &AtomicU64, at: usize, n: usize, mut f: impl FnMut(&mut [u8])) -> [u8; WORD] {
    let mut old = word.load(Ordering::Relaxed);
    loop {
        let mut bytes = old.to_ne_bytes();
        f(&mut bytes[at..at + n]);
        match word.compare_exchange_weak(old, u64::from_ne_bytes(bytes), Ordering::Relaxed, Ordering::Relaxed)
        {
            Ok(_) => return old.to_ne_bytes(),
            Err(now) => old = now,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A 64-byte aligned buffer, as every storage is.
    #[repr(C, align(64))]
    #[derive(Clone)]
    struct Buf([u8; 64]);

    #[test]
    fn unaligned_ranges_round_trip_and_leave_neighbours_alone() {
        let mut b = Buf([0xAA; 64]);
        let p = b.0.as_mut_ptr();
        let src: Vec<u8> = (1..=13).collect();
        let mut back = [0u8; 13];
        let mut long = [0u8; 12];
        // SAFETY: every range below lies in the 64-byte aligned buffer, which lives for the
        // test; `update`'s two bytes 33..35 lie in one word.
        let old = unsafe {
            store(p.add(3), &src);
            load(p.add(3), &mut back);
            copy(p.add(3), p.add(40), 13);
            store(p.add(17), &[5; 12]);
            load(p.add(17), &mut long);
            update(p.add(33), 2, |x| x.copy_from_slice(&[7, 8]))
        };
        assert_eq!(&back[..], &src[..]);
        assert_eq!(long, [5; 12]);
        assert_eq!(&b.0[17..29], &[5; 12]);
        assert_eq!(b.0[29], 0xAA);
        assert_eq!(old[..2], [0xAA, 0xAA]);
        assert_eq!(b.0[2], 0xAA);
        assert_eq!(&b.0[3..16], &src[..]);
        assert_eq!(b.0[16], 0xAA);
        assert_eq!(&b.0[32..36], &[0xAA, 7, 8, 0xAA]);
        assert_eq!(&b.0[40..53], &src[..]);
        assert_eq!(b.0[53], 0xAA);
    }

    #[test]
    fn volatile_copies_land_whole_and_leave_neighbours_alone() {
        // Sources aligned alike and unlike the destination, lengths across word edges and
        // beyond the unaligned path's 4096-byte chunk.
        const N: usize = 80;
        let mut backing = vec![Buf([0; 64]); N];
        for (i, b) in backing.iter_mut().flat_map(|b| b.0.iter_mut()).enumerate() {
            *b = (i * 7 + 1) as u8;
        }
        // SAFETY: the initialised bytes of the 64-byte aligned `backing`, which outlives it.
        let src = unsafe { std::slice::from_raw_parts(backing.as_ptr().cast::<u8>(), N * 64) };
        let cases = [(0, 0, 0), (0, 0, 1), (3, 3, 13), (3, 3, 20), (8, 0, 1024), (1, 6, 700), (5, 2, 5000)];
        for (s_off, d_off, len) in cases {
            let mut dst = vec![Buf([0xAA; 64]); N];
            let d = dst.as_mut_ptr().cast::<u8>();
            // SAFETY: `src[s_off..s_off + len]` is readable; `d_off + len` bytes fit in the
            // N * 64-byte, 64-byte aligned destination, which does not overlap it.
            unsafe { store_from_volatile(src.as_ptr().add(s_off), d.add(d_off), len) };
            // SAFETY: the destination's N * 64 initialised bytes, read after the copy.
            let out = unsafe { std::slice::from_raw_parts(d, N * 64) };
            assert_eq!(&out[d_off..d_off + len], &src[s_off..s_off + len], "{s_off} {d_off} {len}");
            assert!(out[..d_off].iter().chain(&out[d_off + len..]).all(|&b| b == 0xAA));
        }
    }

    #[test]
    fn concurrent_writers_of_neighbouring_bytes_lose_nothing() {
        /// The buffer's address, to hand to threads.
        #[derive(Clone, Copy)]
        struct At(*mut u8);
        // SAFETY: the threads only access the buffer through this module's atomics.
        unsafe impl Send for At {}
        impl At {
            fn get(self) -> *mut u8 {
                self.0
            }
        }
        let mut b = Buf([0; 64]);
        let p = At(b.0.as_mut_ptr());
        std::thread::scope(|s| {
            for i in 0..8usize {
                s.spawn(move || {
                    for v in 0..=255u8 {
                        // SAFETY: byte i of the buffer, which outlives the scope; every
                        // access to it meanwhile is one of this module's atomics.
                        unsafe { store(p.get().add(i), &[v]) };
                    }
                });
            }
        });
        assert_eq!(b.0[..8], [255; 8]);
    }
}
