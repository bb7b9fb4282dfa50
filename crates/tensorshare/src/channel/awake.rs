//! Staying awake for a record: the doorbell senders ring and receivers watch, and how long
//! a receiver polls before it sleeps.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::socket::{Deadline, SPIN};

/// The longest a receive that has a [`Patience`] polls awake before it sleeps.
const PATIENCE_MAX: Duration = Duration::from_micros(500);
/// While polling awake longer than `SPIN`, a receive offers its CPU to anything else that is
/// ready to run on it this often (`sched_yield`), so that its polling costs other work
/// little (it still keeps its own CPU busy).
const YIELD_EVERY: Duration = Duration::from_micros(5);

/// What a channel with a doorbell gives a receive: the bell, and the receiving handle's
/// [`Patience`].
#[derive(Clone, Copy)]
pub(crate) struct Awake<'a> {
    pub(crate) bell: &'a Bell,
    pub(crate) patience: &'a Patience,
}

/// A channel's doorbell, in memory every process holding the channel maps: senders bump
/// `rung` after each record they write, say on which CPU they ran, and wake receivers
/// asleep on `rung`. Peers may write anything here: it only decides when a receiver looks
/// at the channel, and whether it polls awake or sleeps (never longer than its slice).
#[repr(C)]
pub(crate) struct Bell {
    rung: AtomicU32,
    /// The CPU the last sender ran on (`u32::MAX`: unknown).
    cpu: AtomicU32,
    /// Receivers asleep on `rung`, as they say, in the low 16 bits (a killed one leaves the
    /// count high until a wake-up finds nobody), and in the high 16 bits how many times a
    /// receiver has counted itself (so that a count taken for stale is not one renewed
    /// meanwhile).
    sleepers: AtomicU32,
}

/// One more sleeper, and one more registration (see `Bell::sleepers`).
const SLEEPER: u32 = 1 | (1 << 16);
const COUNT: u32 = 0xFFFF;

impl Bell {
    /// How many records were written so far (wrapping): read before a look at the socket.
    pub(super) fn rung(&self) -> u32 {
        self.rung.load(Ordering::Acquire)
    }

    /// Tells receivers polling awake, and one asleep, that a record was written.
    pub(crate) fn ring(&self) {
        self.cpu.store(current_cpu(), Ordering::Relaxed);
        self.rung.fetch_add(1, Ordering::SeqCst);
        let seen = self.sleepers.load(Ordering::SeqCst);
        if seen & COUNT > 0 {
            // Shared (not PRIVATE) futex: the word is in memory other processes map.
            let woken = rustix::thread::futex::wake(&self.rung, rustix::thread::futex::Flags::empty(), 1);
            if woken == Ok(0) {
                // Nobody asleep although the count says so: it is stale (a sleeper was
                // killed), unless a receiver counted itself or left since it was read (the
                // word moved): then it stays. One that counted itself but is not asleep yet
                // sees `rung` moved and does not sleep.
                let _ =
                    self.sleepers.compare_exchange(seen, seen & !COUNT, Ordering::SeqCst, Ordering::Relaxed);
            }
        }
    }

    /// Sleeps until the bell rings after `rung` was read, or `timeout` passes.
    pub(super) fn sleep(&self, rung: u32, timeout: Duration) {
        // Wrapping: the registrations in the high half may wrap (the count cannot reach it).
        self.sleepers.fetch_add(SLEEPER, Ordering::SeqCst);
        let ts = rustix::thread::futex::Timespec {
            tv_sec: timeout.as_secs().min(i64::MAX as u64) as i64,
            tv_nsec: timeout.subsec_nanos() as i64,
        };
        let _ =
            rustix::thread::futex::wait(&self.rung, rustix::thread::futex::Flags::empty(), rung, Some(&ts));
        let _ = self
            .sleepers
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| (n & COUNT > 0).then(|| n - 1));
    }

    /// Whether the last sender ran on this CPU: then polling awake would only keep it (if it
    /// is to send next) from running.
    pub(super) fn sender_shares_this_cpu(&self) -> bool {
        let cpu = current_cpu();
        cpu != u32::MAX && self.cpu.load(Ordering::Relaxed) == cpu
    }
}

fn current_cpu() -> u32 {
    u32::try_from(rustix::thread::sched_getcpu()).unwrap_or(u32::MAX)
}

/// How long a queue's receives poll awake in this process before they sleep, learnt from
/// how long records have taken to come. Private to the process: no peer can make it spin
/// longer.
///
/// A fixed window fails both ways. Where the other side takes a little longer than the
/// window for each turn (a Python peer building a fresh tensor does), every record costs a
/// sleep and a wake-up; and a process woken from sleep runs its next turn slower (on a
/// virtual machine, its virtual CPU was halted and resumes cold), so the turns stay out of
/// the window. A long fixed window would burn a CPU in every idle consumer. So the window
/// follows the waits, as adaptive mutexes do: about twice the recent waits that ended soon,
/// at least [`SPIN`] and at most [`PATIENCE_MAX`]; a wait much longer than that shrinks it
/// again (polling would not have caught it). Beyond `SPIN` the poller yields its CPU every
/// [`YIELD_EVERY`], so that it delays little else that is ready to run there.
pub(crate) struct Patience {
    window_ns: AtomicU64,
}

impl Default for Patience {
    fn default() -> Patience {
        Patience { window_ns: AtomicU64::new(SPIN.as_nanos() as u64) }
    }
}

impl Patience {
    pub(super) fn window(&self) -> Duration {
        Duration::from_nanos(self.window_ns.load(Ordering::Relaxed))
    }

    /// A record came `waited` after the first look found nothing.
    pub(super) fn learn(&self, waited: Duration) {
        let w = self.window();
        let next = if waited <= w {
            // Caught awake: drift towards twice what it took.
            (w * 7 + (waited * 2).clamp(SPIN, PATIENCE_MAX)) / 8
        } else if waited <= PATIENCE_MAX {
            // Came soon after the sleep began: be awake for it next time.
            (waited * 2).min(PATIENCE_MAX)
        } else {
            // Came much later: polling longer would have been wasted.
            (w / 2).max(SPIN)
        };
        self.window_ns.store(next.as_nanos() as u64, Ordering::Relaxed);
    }
}

/// Spins until `bell` moves from `rung`, the spin window closes or the deadline passes;
/// from `yield_after` on, gives the CPU to other ready work every `YIELD_EVERY`. Returns
/// its last reading of the clock, if it read it: the bell moved at most one batch of looks
/// after it (a wait that ended while polling is learnt from it, with no reading more), or
/// during the yield just before it.
pub(super) fn watch(
    bell: &Bell,
    rung: u32,
    until: Instant,
    yield_after: Instant,
    deadline: Deadline,
) -> Option<Instant> {
    let mut next_yield = yield_after;
    let mut seen = None;
    loop {
        // Reading the clock costs more than a look at the word: look a few times per reading.
        for _ in 0..32 {
            if bell.rung.load(Ordering::Acquire) != rung {
                return seen;
            }
            std::hint::spin_loop();
        }
        let now = Instant::now();
        seen = Some(now);
        if now >= until || deadline.passed(now) {
            return seen;
        }
        if now >= next_yield {
            rustix::thread::sched_yield();
            next_yield = now + YIELD_EVERY;
            // The yield may have given the CPU away for a whole slice: a bell that moved
            // meanwhile is then learnt from its end, not from before it.
            seen = Some(Instant::now());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const US: Duration = Duration::from_micros(1);

    fn bell(sleepers: u32) -> Bell {
        Bell { rung: AtomicU32::new(0), cpu: AtomicU32::new(u32::MAX), sleepers: AtomicU32::new(sleepers) }
    }

    /// A count left by sleepers that were killed in their sleep heals at the next ring that
    /// wakes nobody; a sleep counts itself (and its registration) and uncounts itself.
    #[test]
    fn a_stale_sleeper_count_heals_and_a_sleep_counts_itself_once() {
        let b = bell(3 | (7 << 16));
        b.ring();
        assert_eq!(b.sleepers.load(Ordering::SeqCst), 7 << 16, "healed, registrations kept");
        b.sleep(b.rung(), Duration::from_millis(1));
        assert_eq!(b.sleepers.load(Ordering::SeqCst), 8 << 16, "one more registration, no sleeper");
        // A sleep on a value the bell has left returns at once.
        let before = Instant::now();
        b.sleep(b.rung().wrapping_sub(1), Duration::from_secs(5));
        assert!(before.elapsed() < Duration::from_secs(5));
    }

    #[test]
    fn patience_grows_to_catch_a_record_that_came_soon_after_the_sleep() {
        let p = Patience::default();
        assert_eq!(p.window(), SPIN);
        p.learn(60 * US);
        assert_eq!(p.window(), 120 * US);
        // Never beyond the cap, however close the miss.
        p.learn(400 * US);
        assert_eq!(p.window(), PATIENCE_MAX);
    }

    #[test]
    fn patience_shrinks_when_records_come_much_later_or_much_sooner() {
        let p = Patience::default();
        p.learn(PATIENCE_MAX);
        assert_eq!(p.window(), PATIENCE_MAX);
        // A wait polling could not have covered halves the window, down to SPIN.
        p.learn(10 * PATIENCE_MAX);
        assert_eq!(p.window(), PATIENCE_MAX / 2);
        for _ in 0..8 {
            p.learn(Duration::from_millis(50));
        }
        assert_eq!(p.window(), SPIN);
        // A near miss sets it to twice the wait; records caught awake then pull it towards
        // twice their wait, an eighth of the way each time, never below SPIN.
        p.learn(200 * US);
        assert_eq!(p.window(), 400 * US);
        p.learn(150 * US);
        assert_eq!(p.window(), Duration::from_nanos(387_500));
        for _ in 0..200 {
            p.learn(US);
        }
        assert!(p.window() >= SPIN && p.window() < SPIN + 2 * US, "{:?}", p.window());
    }
}
