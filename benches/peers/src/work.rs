//! What one run does (a workload with its counts), what it reports, and the small helpers
//! every system's side shares.

use std::fmt::Debug;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

/// Errors carry a sentence; the benchmark prints it and stops.
pub type Res<T> = Result<T, String>;

/// `?` with a word on what failed, for the many error types of three libraries and the OS.
pub trait Ctx<T> {
    fn ctx(self, what: &str) -> Res<T>;
}

impl<T, E: Debug> Ctx<T> for Result<T, E> {
    fn ctx(self, what: &str) -> Res<T> {
        self.map_err(|e| format!("{what}: {e:?}"))
    }
}

/// One run of one workload: the workload of BENCHMARKS.md with the counts chosen for it.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub enum Job {
    /// `size` bytes parent → child → parent, `rounds` timed after `warmup` untimed ones;
    /// `same`: one buffer re-sent every round, else a new one filled with ones.
    PingPong { size: usize, same: bool, rounds: usize, warmup: usize },
    /// `count` new buffers of `size` bytes, each filled with its index, producer → consumer.
    Stream { size: usize, count: usize },
    /// `count` messages of `k` new buffers of `size` bytes each.
    Batch { size: usize, k: usize, count: usize },
}

impl Job {
    /// Elements of f32 in one buffer.
    pub fn elements(self) -> usize {
        let size = match self {
            Job::PingPong { size, .. } | Job::Stream { size, .. } | Job::Batch { size, .. } => size,
        };
        (size / 4).max(1)
    }

    /// The job as command-line words, for a peer process (see `from_args`).
    pub fn to_args(self) -> Vec<String> {
        match self {
            Job::PingPong { size, same, rounds, warmup } => vec![
                "pingpong".into(),
                size.to_string(),
                if same { "same" } else { "fresh" }.into(),
                rounds.to_string(),
                warmup.to_string(),
            ],
            Job::Stream { size, count } => vec!["stream".into(), size.to_string(), count.to_string()],
            Job::Batch { size, k, count } => {
                vec!["batch".into(), size.to_string(), k.to_string(), count.to_string()]
            }
        }
    }

    /// Reads a job from the front of `args`, as `to_args` wrote it; returns the words after it.
    pub fn from_args(args: &[String]) -> Res<(Job, &[String])> {
        let num = |i: usize| -> Res<usize> {
            args.get(i)
                .ok_or_else(|| format!("job: missing word {i} in {args:?}"))?
                .parse()
                .map_err(|_| format!("job: bad number at word {i} in {args:?}"))
        };
        match args.first().map(String::as_str) {
            Some("pingpong") => {
                let same = match args.get(2).map(String::as_str) {
                    Some("same") => true,
                    Some("fresh") => false,
                    other => return Err(format!("job: fresh or same, not {other:?}")),
                };
                let job = Job::PingPong { size: num(1)?, same, rounds: num(3)?, warmup: num(4)? };
                Ok((job, &args[5..]))
            }
            Some("stream") => Ok((Job::Stream { size: num(1)?, count: num(2)? }, &args[3..])),
            Some("batch") => Ok((Job::Batch { size: num(1)?, k: num(2)?, count: num(3)? }, &args[4..])),
            other => Err(format!("job: unknown workload {other:?}")),
        }
    }
}

/// One run's figures: (key, value), the first being the one the table compares.
pub type Figures = Vec<(&'static str, f64)>;

/// Median and p99 of one-way latencies (round trip / 2), in µs.
pub fn latency_figures(mut one_way: Vec<Duration>) -> Figures {
    one_way.sort();
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    let n = one_way.len();
    vec![("median_us", us(one_way[n / 2])), ("p99_us", us(one_way[n * 99 / 100]))]
}

/// Stream throughput: `items` of `size` bytes after the first, in `seconds`.
pub fn stream_figures(size: usize, items: usize, seconds: f64) -> Figures {
    vec![("GBps", (size * items) as f64 / seconds / 1e9)]
}

/// Batch throughput: `tensors` after the first message, in `seconds`.
pub fn batch_figures(tensors: usize, seconds: f64) -> Figures {
    vec![("tensors_per_s", tensors as f64 / seconds)]
}

/// Sums f32 with eight lanes, so the sum runs at memory speed (as `tensorshare bench` does).
pub fn sum_f32(v: &[f32]) -> f64 {
    let mut acc = [0f32; 8];
    let chunks = v.chunks_exact(8);
    let rest = chunks.remainder();
    for c in chunks {
        for (a, x) in acc.iter_mut().zip(c) {
            *a += x;
        }
    }
    acc.iter().map(|x| *x as f64).sum::<f64>() + rest.iter().map(|x| *x as f64).sum::<f64>()
}

/// `sum_f32` over bytes that hold native-endian f32 (ipc-channel hands out `&[u8]`); the
/// compiler turns the byte loads into the same vector loads.
pub fn sum_f32_bytes(b: &[u8]) -> f64 {
    let mut acc = [0f32; 8];
    let chunks = b.chunks_exact(32);
    let rest = chunks.remainder();
    for c in chunks {
        for (a, x) in acc.iter_mut().zip(c.chunks_exact(4)) {
            *a += f32::from_ne_bytes([x[0], x[1], x[2], x[3]]);
        }
    }
    let tail: f64 = rest.chunks_exact(4).map(|c| f32::from_ne_bytes([c[0], c[1], c[2], c[3]]) as f64).sum();
    acc.iter().map(|x| *x as f64).sum::<f64>() + tail
}

/// What a stream's consumer must have summed: item i holds `n` copies of i. Exact in f64 (and
/// in the f32 lanes) for the sizes and counts used here, so any lost or torn item shows.
pub fn stream_expected(n: usize, count: usize) -> f64 {
    n as f64 * (count as f64 * (count as f64 - 1.0) / 2.0)
}

/// `n` f32 of value `v` as native-endian bytes: the source a copying API starts from.
pub fn f32_bytes(n: usize, v: f32) -> Vec<u8> {
    std::iter::repeat_n(v.to_ne_bytes(), n).flatten().collect()
}

/// Fills `b` with native-endian copies of `v`.
pub fn fill_f32_bytes(b: &mut [u8], v: f32) {
    let x = v.to_ne_bytes();
    for c in b.chunks_exact_mut(4) {
        c.copy_from_slice(&x);
    }
}

/// How long a waiting side waits for its peer before it gives up: a peer that died or hung
/// must end the benchmark with an error, not stall it.
pub const PATIENCE: Duration = Duration::from_secs(30);

/// A clock for `PATIENCE`, read only now and then so that spinning stays cheap.
pub struct Patience {
    since: Instant,
    spins: u32,
}

impl Patience {
    pub fn start() -> Self {
        Patience { since: Instant::now(), spins: 0 }
    }

    /// Counts one fruitless look; every 4096 looks checks the clock.
    pub fn spin(&mut self, what: &str) -> Res<()> {
        self.spins = self.spins.wrapping_add(1);
        if self.spins.is_multiple_of(4096) {
            self.check(what)?;
        }
        Ok(())
    }

    /// Fails once `PATIENCE` has passed.
    pub fn check(&self, what: &str) -> Res<()> {
        if self.since.elapsed() > PATIENCE {
            return Err(format!("{what}: nothing from the peer for {} s", PATIENCE.as_secs()));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jobs_survive_the_command_line() {
        for job in [
            Job::PingPong { size: 4096, same: true, rounds: 10, warmup: 2 },
            Job::PingPong { size: 1 << 20, same: false, rounds: 3, warmup: 1 },
            Job::Stream { size: 4096, count: 7 },
            Job::Batch { size: 1024, k: 100, count: 5 },
        ] {
            let mut args = job.to_args();
            args.push("rest".into());
            let (back, rest) = Job::from_args(&args).unwrap();
            assert_eq!((back, rest), (job, &["rest".to_string()][..]));
        }
    }

    #[test]
    fn both_sums_agree() {
        let v: Vec<f32> = (0..1031).map(|i| i as f32).collect();
        let b: Vec<u8> = v.iter().flat_map(|x| x.to_ne_bytes()).collect();
        assert_eq!(sum_f32(&v), sum_f32_bytes(&b));
        assert_eq!(sum_f32(&v), 1031.0 * 1030.0 / 2.0);
        let mut ones = vec![0u8; 40];
        fill_f32_bytes(&mut ones, 1.0);
        assert_eq!((ones, f32_bytes(10, 1.0).len()), (f32_bytes(10, 1.0), 40));
    }
}
