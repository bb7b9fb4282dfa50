//! `tensorshare demo`: a DataLoader-shaped pipeline. Worker processes build batches (an
//! image-like u8 tensor, f32 labels, a few strings) straight into shared memory and put
//! them on a queue; the main process takes and checks every batch. Then the same batches
//! go through a plain pipe by copying, for contrast.

use std::io::{Read, Write};
use std::os::fd::OwnedFd;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};
use serde::{Deserialize, Serialize};
use tensorshare::{set_sharing_strategy, spawn, DType, Queue, SharedFd, SharingStrategy, Tensor};

use crate::info::human;

#[derive(Clone, Copy, Serialize, Deserialize)]
pub struct Options {
    pub workers: usize,
    pub batches: usize,
    pub batch_size: usize,
    pub side: usize,
    pub strategy: SharingStrategy,
}

#[derive(Serialize, Deserialize)]
struct Batch {
    index: u64,
    images: Tensor,
    labels: Tensor,
    split: String,
    source: String,
    worker: String,
    /// CLOCK_MONOTONIC at creation, the same clock in every process.
    created_ns: u64,
}

fn now_ns() -> u64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64
}

fn pixel(index: u64, sample: usize) -> u8 {
    (index.wrapping_mul(31).wrapping_add(sample as u64 * 7) % 251) as u8
}

/// Builds batch `index`; `shared`: straight into shared memory (what tensorshare workers
/// do), otherwise in private memory (what the copying pipeline does).
fn make_batch(o: &Options, index: u64, rank: usize, shared: bool) -> tensorshare::Result<Batch> {
    let (b, s) = (o.batch_size, o.side);
    let shape = [b, 3, s, s];
    let mut images =
        if shared { Tensor::empty_shared(&shape, DType::U8)? } else { Tensor::zeros(&shape, DType::U8) };
    let per = 3 * s * s;
    // Written in place, where the consumer will read it. SAFETY: the tensor is fresh and
    // not sent yet: this is its only handle, in any process, until it is put on the queue.
    for (i, img) in unsafe { images.as_mut_slice::<u8>()? }.chunks_mut(per).enumerate() {
        img.fill(pixel(index, i));
    }
    let mut labels =
        if shared { Tensor::empty_shared(&[b], DType::F32)? } else { Tensor::zeros(&[b], DType::F32) };
    let values: Vec<f32> = (0..b).map(|i| (index as usize * b + i) as f32).collect();
    labels.copy_from_slice(&values)?;
    Ok(Batch {
        index,
        images,
        labels,
        split: "train".into(),
        source: format!("synthetic/{index:06}.bin"),
        worker: format!("worker-{rank}"),
        created_ns: now_ns(),
    })
}

/// Checks every byte and label of a batch.
fn check(o: &Options, batch: &Batch) -> Result<(), String> {
    let per = 3 * o.side * o.side;
    // Read in place, without a copy. SAFETY: the producer wrote the batch before `put` (the
    // queue orders that before our `get`) and kept no handle to it; nothing writes it while
    // it is checked.
    let images = unsafe { batch.images.as_slice::<u8>() }.map_err(|e| e.to_string())?;
    for (i, img) in images.chunks(per).enumerate() {
        let want = pixel(batch.index, i);
        if !img.iter().all(|p| *p == want) {
            return Err(format!("batch {} sample {i}: wrong pixels", batch.index));
        }
    }
    let labels = batch.labels.to_vec::<f32>().map_err(|e| e.to_string())?;
    for (i, l) in labels.iter().enumerate() {
        if *l != (batch.index as usize * o.batch_size + i) as f32 {
            return Err(format!("batch {} label {i}: {l}", batch.index));
        }
    }
    if batch.split != "train" || !batch.source.ends_with(".bin") || !batch.worker.starts_with("worker-") {
        return Err(format!("batch {}: wrong strings", batch.index));
    }
    Ok(())
}

fn shared_worker(rank: usize, (q, o): (Queue<Batch>, Options)) -> tensorshare::Result<()> {
    set_sharing_strategy(o.strategy)?;
    for index in (rank..o.batches).step_by(o.workers) {
        q.put(make_batch(&o, index as u64, rank, true)?)?;
    }
    Ok(())
}

fn pipe_worker(rank: usize, (fd, o): (SharedFd, Options)) -> Result<(), String> {
    let fd = fd.into_owned().map_err(|_| "the pipe is shared".to_string())?;
    let mut out = std::io::BufWriter::new(std::fs::File::from(fd));
    for index in (rank..o.batches).step_by(o.workers) {
        let b = make_batch(&o, index as u64, rank, false).map_err(|e| e.to_string())?;
        // Outside a message a tensor serializes by value: this is the copying pipeline.
        let bytes = postcard::to_allocvec(&b).map_err(|e| e.to_string())?;
        out.write_all(&(bytes.len() as u64).to_le_bytes()).map_err(|e| e.to_string())?;
        out.write_all(&bytes).map_err(|e| e.to_string())?;
    }
    out.flush().map_err(|e| e.to_string())
}

struct Stats {
    seconds: f64,
    bytes: u64,
    latencies: Vec<Duration>,
    peak_shm: u64,
    peak_fds: usize,
}

impl Stats {
    fn new() -> Stats {
        Stats { seconds: 0.0, bytes: 0, latencies: Vec::new(), peak_shm: 0, peak_fds: 0 }
    }

    fn record(&mut self, b: &Batch) {
        self.bytes += (b.images.numel() + b.labels.numel() * 4) as u64;
        self.latencies.push(Duration::from_nanos(now_ns().saturating_sub(b.created_ns)));
        if self.latencies.len() % 8 == 1 {
            self.peak_shm = self.peak_shm.max(rss_shmem());
            self.peak_fds = self.peak_fds.max(open_fds());
        }
    }

    fn quantile(&self, q: f64) -> Duration {
        let mut l = self.latencies.clone();
        l.sort();
        l.get(((l.len() as f64 - 1.0) * q) as usize).copied().unwrap_or_default()
    }
}

fn rss_shmem() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    s.lines()
        .find_map(|l| l.strip_prefix("RssShmem:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map(|kb| kb * 1024)
        .unwrap_or(0)
}

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").map(|d| d.count().saturating_sub(1)).unwrap_or(0)
}

fn bar(n: usize, what: &str) -> ProgressBar {
    let pb = ProgressBar::new(n as u64);
    pb.set_style(
        ProgressStyle::with_template("{prefix:>12} [{bar:40}] {pos}/{len} batches {per_sec} {msg}")
            .expect("a valid template")
            .progress_chars("=> "),
    );
    pb.set_prefix(what.to_string());
    pb
}

fn run_shared(o: &Options) -> Result<Stats, String> {
    let q: Queue<Batch> = Queue::with_capacity(2 * o.workers).map_err(|e| e.to_string())?;
    let mut ctx = spawn(shared_worker, (q.clone(), *o), o.workers).map_err(|e| e.to_string())?;
    let pb = bar(o.batches, "tensorshare");
    let mut st = Stats::new();
    let t0 = Instant::now();
    for _ in 0..o.batches {
        let b = q.get().map_err(|e| e.to_string())?;
        check(o, &b)?;
        st.record(&b);
        pb.inc(1);
    }
    st.seconds = t0.elapsed().as_secs_f64();
    st.peak_fds = st.peak_fds.max(open_fds());
    pb.finish();
    ctx.join(None).map_err(|e| e.to_string())?;
    Ok(st)
}

fn read_batch(r: &mut impl Read) -> Result<Option<Batch>, String> {
    let mut len = [0u8; 8];
    match r.read_exact(&mut len) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e.to_string()),
    }
    let mut buf = vec![0u8; u64::from_le_bytes(len) as usize];
    r.read_exact(&mut buf).map_err(|e| e.to_string())?;
    postcard::from_bytes(&buf).map(Some).map_err(|e| e.to_string())
}

fn run_pipe(o: &Options) -> Result<Stats, String> {
    // One pipe per worker: writes to a shared pipe above PIPE_BUF bytes would interleave.
    let mut readers = Vec::new();
    let mut contexts = Vec::new();
    for rank in 0..o.workers {
        let (r, w): (OwnedFd, OwnedFd) = rustix::pipe::pipe().map_err(|e| e.to_string())?;
        contexts.push(spawn(pipe_worker_rank, (SharedFd::new(w), *o, rank), 1).map_err(|e| e.to_string())?);
        readers.push(std::io::BufReader::with_capacity(1 << 20, std::fs::File::from(r)));
    }
    let pb = bar(o.batches, "plain pipe");
    let mut st = Stats::new();
    let t0 = Instant::now();
    let mut open = readers.len();
    while open > 0 {
        open = 0;
        for r in &mut readers {
            if let Some(b) = read_batch(r)? {
                check(o, &b)?;
                st.record(&b);
                pb.inc(1);
                open += 1;
            }
        }
    }
    st.seconds = t0.elapsed().as_secs_f64();
    pb.finish();
    for mut c in contexts {
        c.join(None).map_err(|e| e.to_string())?;
    }
    Ok(st)
}

/// A pipe worker, started alone, that builds the batches of `rank` among the demo's
/// workers.
fn pipe_worker_rank(_: usize, (fd, o, rank): (SharedFd, Options, usize)) -> Result<(), String> {
    pipe_worker(rank, (fd, o))
}

pub fn run(o: Options) -> Result<(), String> {
    if o.workers == 0 || o.batches == 0 || o.batch_size == 0 || o.side == 0 {
        return Err("workers, batches, batch size and image side must be positive".into());
    }
    set_sharing_strategy(o.strategy).map_err(|e| e.to_string())?;
    let mb = (o.batch_size * 3 * o.side * o.side) as f64 / 1e6;
    println!(
        "{} workers build {} batches of {} images 3x{}x{} ({mb:.1} MB each) with labels and strings; \
         strategy {}",
        o.workers, o.batches, o.batch_size, o.side, o.side, o.strategy
    );
    let shared = run_shared(&o)?;
    // Unmap what the first run left mapped, so the second run's figures are its own.
    tensorshare::trim_arenas();
    let copied = run_pipe(&o)?;
    let row = |name: &str, a: String, b: String| println!("{name:<26} {a:>20} {b:>20}");
    println!();
    row("", "tensorshare".into(), "plain pipe (copy)".into());
    let rate = |s: &Stats| format!("{:.0}", o.batches as f64 / s.seconds);
    row("batches/s", rate(&shared), rate(&copied));
    let gbps = |s: &Stats| format!("{:.2}", s.bytes as f64 / s.seconds / 1e9);
    row("GB/s", gbps(&shared), gbps(&copied));
    let ms = |d: Duration| format!("{:.2} ms", d.as_secs_f64() * 1e3);
    row("latency p50", ms(shared.quantile(0.5)), ms(copied.quantile(0.5)));
    row("latency p99", ms(shared.quantile(0.99)), ms(copied.quantile(0.99)));
    row("peak shared memory mapped", human(shared.peak_shm), "none (copies)".into());
    row("descriptors held (peak)", shared.peak_fds.to_string(), copied.peak_fds.to_string());
    println!(
        "\nevery batch checked: {} of {} through shared memory, {} through the pipe; speed-up {:.1}x\n",
        shared.latencies.len(),
        o.batches,
        copied.latencies.len(),
        copied.seconds / shared.seconds
    );
    if copied.latencies.len() != o.batches {
        return Err(format!("the pipe delivered {} of {} batches", copied.latencies.len(), o.batches));
    }
    Ok(())
}
