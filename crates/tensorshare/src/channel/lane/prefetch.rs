//! Asking the CPU for a cache line before it is written (see `Ring::prepare_claim`).

/// Asks the CPU to bring the cache line of `p` into its cache for writing, without waiting;
/// nothing where it cannot.
#[inline(always)]
pub(super) fn for_write(p: *const u8) {
    #[cfg(all(target_arch = "x86_64", not(miri)))]
    if has_prefetchw() {
        // SAFETY: the CPU has PREFETCHW (CPUID says so, see `has_prefetchw`). It is a hint:
        // it reads and writes nothing the program can see and never faults, whatever the
        // address. It touches no register but its address operand, and no flags or stack.
        unsafe {
            std::arch::asm!("prefetchw [{0}]", in(reg) p, options(nostack, preserves_flags, readonly));
        }
    }
    #[cfg(not(all(target_arch = "x86_64", not(miri))))]
    let _ = p;
}

/// Whether this CPU has PREFETCHW (CPUID leaf 8000_0001h, ECX bit 8), asked once per process.
#[cfg(all(target_arch = "x86_64", not(miri)))]
fn has_prefetchw() -> bool {
    use std::sync::atomic::{AtomicU8, Ordering};
    /// 0: not asked yet; 1: no; 2: yes.
    static KNOWN: AtomicU8 = AtomicU8::new(0);
    match KNOWN.load(Ordering::Relaxed) {
        0 => {
            use std::arch::x86_64::__cpuid;
            #[allow(unused_unsafe)] // `__cpuid` is safe in newer Rust, unsafe in older.
            // SAFETY: every x86-64 CPU has CPUID, and leaf 8000_0000h says which extended
            // leaves it has before 8000_0001h is asked.
            let yes = unsafe {
                __cpuid(0x8000_0000).eax >= 0x8000_0001 && __cpuid(0x8000_0001).ecx & (1 << 8) != 0
            };
            KNOWN.store(if yes { 2 } else { 1 }, Ordering::Relaxed);
            yes
        }
        known => known == 2,
    }
}
