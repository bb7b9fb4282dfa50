//! Small helpers shared by several modules.

/// Fills `buf` with random bytes from the kernel. Falls back to a mix of time and pid,
/// which is enough for the uses here (unique names, not secrets).
pub(crate) fn random_bytes(buf: &mut [u8]) {
    if rustix::rand::getrandom(&mut *buf, rustix::rand::GetRandomFlags::empty()).map(|n| n == buf.len())
        == Ok(true)
    {
        return;
    }
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    let mut x = t ^ (u64::from(rustix::process::getpid().as_raw_nonzero().get() as u32) << 32);
    for b in buf {
        // xorshift64
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = x as u8;
    }
}

/// Locks `m`, also after another thread panicked while holding it: every structure behind
/// the library's mutexes stays valid at each step (they hold caches and bookkeeping whose
/// invariants no panic can leave half-updated), so a poisoned lock is still usable.
pub(crate) fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A multiplicative hash (FxHash's), for the maps of the per-message path, whose keys no
/// peer chooses freely: addresses in this process, descriptor numbers, device/inode
/// numbers the kernel gave, slot numbers checked against their arena. SipHash's flooding
/// resistance buys nothing there, and costs a tenth of a small message's encoding. The
/// product's high bits are the well-mixed ones: `finish` rotates them down to where a map
/// picks its bucket, so that keys with zero low bits (aligned addresses) do not all start
/// their probe at the same bucket.
#[derive(Default, Clone, Copy)]
pub(crate) struct FastHasher(u64);

impl std::hash::Hasher for FastHasher {
    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.write_u64(u64::from_le_bytes(word));
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(5) ^ n).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }

    fn write_u32(&mut self, n: u32) {
        self.write_u64(n.into());
    }

    fn write_usize(&mut self, n: usize) {
        self.write_u64(n as u64);
    }

    fn finish(&self) -> u64 {
        self.0.rotate_left(26)
    }
}

/// A `HashMap` with [`FastHasher`].
pub(crate) type FastMap<K, V> = std::collections::HashMap<K, V, std::hash::BuildHasherDefault<FastHasher>>;

pub(crate) mod fork;
pub(crate) mod fork_mutex;
mod lazy;

pub(crate) use lazy::Lazy;

#[cfg(test)]
mod tests {
    use std::hash::{BuildHasher, BuildHasherDefault};

    use super::FastHasher;

    #[test]
    fn aligned_addresses_spread_over_the_low_bits() {
        // A map picks a key's first bucket from the hash's low bits: keys that are multiples
        // of 64 (arena slots, storage addresses) must not all land on the same few.
        let build = BuildHasherDefault::<FastHasher>::default();
        let mut seen = std::collections::HashSet::new();
        for k in 0..4096u64 {
            seen.insert(build.hash_one(0x7f00_0000_0000 + k * 64) & 1023);
        }
        assert!(seen.len() > 900, "{} of 1024 buckets", seen.len());
    }
}
