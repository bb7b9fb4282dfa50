//! `tensorshare bench`: the workloads of torch_baseline.py, with the same names, arguments
//! and JSON keys, so the two systems can be joined line by line.

use std::time::{Duration, Instant};

use tensorshare::{set_sharing_strategy, spawn, DType, Queue, SharingStrategy, Tensor};

/// One workload's figures, as (key, value) pairs in the order torch's script prints them.
pub struct Figures(pub Vec<(&'static str, f64)>);

/// A workload's figures over several runs: per key, the median, minimum and maximum.
pub struct Summary {
    pub runs: usize,
    pub figures: Vec<Spread>,
}

/// One figure over the runs.
pub struct Spread {
    pub key: &'static str,
    pub median: f64,
    pub min: f64,
    pub max: f64,
}

/// Runs `w` `runs` times (at least once) and summarises each figure. The median of an even
/// number of runs is the mean of the middle two.
pub fn repeat(w: &Workload, strategy: SharingStrategy, runs: usize) -> Result<Summary, String> {
    let all: Vec<Figures> = (0..runs.max(1)).map(|_| run(w, strategy)).collect::<Result<_, _>>()?;
    Ok(summarise(&all))
}

/// Per key (in the first run's order), the median, minimum and maximum over `all`.
pub fn summarise(all: &[Figures]) -> Summary {
    let keys: Vec<&'static str> =
        all.first().map(|f| f.0.iter().map(|(k, _)| *k).collect()).unwrap_or_default();
    let figures = keys
        .into_iter()
        .map(|key| {
            let mut v: Vec<f64> =
                all.iter().filter_map(|f| f.0.iter().find(|(k, _)| *k == key).map(|(_, x)| *x)).collect();
            v.sort_by(f64::total_cmp);
            let n = v.len();
            let median = if n % 2 == 1 { v[n / 2] } else { (v[n / 2 - 1] + v[n / 2]) / 2.0 };
            Spread { key, median, min: v[0], max: v[n - 1] }
        })
        .collect();
    Summary { runs: all.len(), figures }
}

/// A workload with its arguments, as the command line and the JSON give them.
pub struct Workload {
    pub name: String,
    pub args: Vec<String>,
}

/// The full table of BENCHMARKS.md.
pub fn all() -> Vec<Workload> {
    let w = |name: &str, args: &[&str]| Workload {
        name: name.into(),
        args: args.iter().map(|s| s.to_string()).collect(),
    };
    vec![
        w("pingpong", &["4096", "2000", "fresh"]),
        w("pingpong", &["4096", "2000", "same"]),
        w("pingpong", &["1048576", "500", "fresh"]),
        w("pingpong", &["67108864", "30", "fresh"]),
        w("stream", &["4096", "5000"]),
        w("stream", &["1048576", "1907"]),
        w("stream", &["67108864", "29"]),
        w("batch", &["1024", "100", "50"]),
        w("spawn", &["8"]),
        w("spawn", &["1"]),
    ]
}

fn arg<T: std::str::FromStr>(args: &[String], i: usize, what: &str) -> Result<T, String> {
    args.get(i)
        .ok_or_else(|| format!("missing {what}"))?
        .parse()
        .map_err(|_| format!("bad {what}: {:?}", args[i]))
}

pub fn run(w: &Workload, strategy: SharingStrategy) -> Result<Figures, String> {
    set_sharing_strategy(strategy).map_err(|e| e.to_string())?;
    let a = &w.args;
    match w.name.as_str() {
        "pingpong" => pingpong(
            arg(a, 0, "SIZE")?,
            arg(a, 1, "ROUNDS")?,
            &arg::<String>(a, 2, "fresh|same")?,
            tensorshare::Device::Cpu,
        ),
        #[cfg(feature = "cuda")]
        "cuda_pingpong" => pingpong(
            arg(a, 0, "SIZE")?,
            arg(a, 1, "ROUNDS")?,
            &arg::<String>(a, 2, "fresh|same")?,
            tensorshare::Device::Cuda(0),
        ),
        #[cfg(feature = "cuda")]
        "cuda_first_use" => {
            cuda_first_use(arg(a, 0, "SIZE")?, arg(a, 1, "ROUNDS")?, &arg::<String>(a, 2, "fresh|same")?)
        }
        "stream" => stream(arg(a, 0, "SIZE")?, arg(a, 1, "COUNT")?, strategy),
        "batch" => batch(arg(a, 0, "SIZE")?, arg(a, 1, "K")?, arg(a, 2, "COUNT")?, strategy),
        "spawn" => spawn_workers(arg(a, 0, "N")?),
        other => Err(format!(
            "unknown workload {other:?}; expected pingpong, stream, batch, spawn{}",
            if cfg!(feature = "cuda") {
                ", cuda_pingpong or cuda_first_use"
            } else {
                " (cuda_pingpong and cuda_first_use need --features cuda)"
            }
        )),
    }
    .map_err(|e| format!("{} {}: {e}", w.name, w.args.join(" ")))
}

fn err(e: impl std::fmt::Display) -> String {
    e.to_string()
}

/// A new tensor of `n` f32 set to `v`, made where tensors that will be sent belong: in
/// shared memory, so sending it copies nothing.
///
/// Filled through the zero-copy borrow, as a program that makes its own batches would: the
/// safe `fill` stores word by word with atomics (other processes may write shared memory),
/// which costs a few times a `memset` on large tensors.
fn fresh(n: usize, v: f32) -> Result<Tensor, String> {
    let mut t = Tensor::empty_shared(&[n], DType::F32).map_err(err)?;
    // SAFETY: `t` was just made from a slot no process holds (the allocator asks the kernel
    // before it hands a sent slot out again); it has no clone or view and has not been sent,
    // so nothing else in this program or in another cooperating process reads or writes its
    // elements while this borrow lives; any f32 bit pattern is valid.
    unsafe { t.as_mut_slice::<f32>() }.map_err(err)?.fill(v);
    Ok(t)
}

/// `fresh` on `device`: in shared memory on the host, a device allocation of its own on a
/// CUDA device.
fn fresh_on(device: tensorshare::Device, n: usize, v: f32) -> Result<Tensor, String> {
    match device {
        #[cfg(feature = "cuda")]
        tensorshare::Device::Cuda(_) => {
            let mut t = Tensor::empty_on(&[n], DType::F32, device).map_err(err)?;
            t.fill(v).map_err(err)?;
            Ok(t)
        }
        _ => fresh(n, v),
    }
}

/// Rounds every pingpong-shaped workload runs before it starts timing.
const WARMUP: usize = 50;

/// Whether a pingpong-shaped workload sends one tensor again (`same`) or a new one each round
/// (`fresh`), with its rounds checked.
fn same_mode(mode: &str, rounds: usize) -> Result<bool, String> {
    if rounds == 0 {
        return Err("ROUNDS must be at least 1".into());
    }
    match mode {
        "same" => Ok(true),
        "fresh" => Ok(false),
        m => Err(format!("mode must be fresh or same, not {m:?}")),
    }
}

fn echo(_rank: usize, (to, from, rounds): (Queue<Tensor>, Queue<Tensor>, usize)) {
    for _ in 0..rounds {
        let t = to.get().expect("pingpong: get");
        from.put(t).expect("pingpong: put");
    }
}

fn pingpong(size: usize, rounds: usize, mode: &str, device: tensorshare::Device) -> Result<Figures, String> {
    let same_mode = same_mode(mode, rounds)?;
    let n = (size / 4).max(1);
    let to: Queue<Tensor> = Queue::new().map_err(err)?;
    let from: Queue<Tensor> = Queue::new().map_err(err)?;
    let mut ctx = spawn(echo, (to.clone(), from.clone(), rounds + WARMUP), 1).map_err(err)?;
    let same = fresh_on(device, n, 1.0)?;
    let one = |t0: Instant| -> Result<Duration, String> {
        let t = if same_mode { same.clone() } else { fresh_on(device, n, 1.0)? };
        to.put(t).map_err(err)?;
        let r = from.get().map_err(err)?;
        let rtt = t0.elapsed();
        drop(r);
        Ok(rtt / 2)
    };
    for _ in 0..WARMUP {
        one(Instant::now())?;
    }
    let mut lat: Vec<Duration> = (0..rounds).map(|_| one(Instant::now())).collect::<Result<_, _>>()?;
    ctx.join(None).map_err(err)?;
    lat.sort();
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    Ok(Figures(vec![("median_us", us(lat[lat.len() / 2])), ("p99_us", us(lat[lat.len() * 99 / 100]))]))
}

/// CLOCK_MONOTONIC in nanoseconds: one clock for every process of the machine, so a time
/// taken by the sender can be subtracted from one taken by the receiver.
#[cfg(feature = "cuda")]
fn monotonic_ns() -> u64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64
}

/// The consumer of `cuda_first_use`: takes each tensor, reads its first element to the host
/// (its first use: the copy waits for the sender's work on the tensor), checks it, and
/// answers with the nanoseconds from the sender's `put` to that read.
#[cfg(feature = "cuda")]
fn first_use(_rank: usize, (to, from, rounds): (Queue<(Tensor, u64)>, Queue<u64>, usize)) {
    for _ in 0..rounds {
        let (t, sent) = to.get().expect("first use: get");
        let v = t.narrow(0, 0, 1).and_then(|h| h.to_vec::<f32>()).expect("first use: read");
        let took = monotonic_ns().saturating_sub(sent);
        assert_eq!(v, [1.0], "the consumer read the tensor before the sender's fill was done");
        drop(t);
        from.put(took).expect("first use: put");
    }
}

/// The time from a CUDA tensor's `put` to its first use by the consumer (a read of one
/// element to the host, after the sender's fill), one tensor in flight at a time; `fresh`
/// makes and fills a new tensor for every round, without synchronising before the `put`.
#[cfg(feature = "cuda")]
fn cuda_first_use(size: usize, rounds: usize, mode: &str) -> Result<Figures, String> {
    let same_mode = same_mode(mode, rounds)?;
    let device = tensorshare::Device::Cuda(0);
    let n = (size / 4).max(1);
    let to: Queue<(Tensor, u64)> = Queue::new().map_err(err)?;
    let from: Queue<u64> = Queue::new().map_err(err)?;
    let mut ctx = spawn(first_use, (to.clone(), from.clone(), rounds + WARMUP), 1).map_err(err)?;
    let same = fresh_on(device, n, 1.0)?;
    let mut lat = Vec::with_capacity(rounds);
    for i in 0..rounds + WARMUP {
        let t = if same_mode { same.clone() } else { fresh_on(device, n, 1.0)? };
        to.put((t, monotonic_ns())).map_err(err)?;
        // Bounded: a consumer that failed (its check panics) never answers.
        let took = from.get_timeout(Duration::from_secs(60)).map_err(|e| format!("the consumer: {e}"))?;
        if i >= WARMUP {
            lat.push(took as f64 / 1e3);
        }
    }
    ctx.join(None).map_err(err)?;
    lat.sort_by(f64::total_cmp);
    Ok(Figures(vec![("median_us", lat[lat.len() / 2]), ("p99_us", lat[lat.len() * 99 / 100])]))
}

/// Sums f32 with eight lanes, so the sum runs at memory speed.
pub fn sum_f32(v: &[f32]) -> f64 {
    let mut acc = [0f32; 8];
    let chunks = v.chunks_exact(8);
    let rest = chunks.remainder();
    for c in chunks {
        for i in 0..8 {
            acc[i] += c[i];
        }
    }
    acc.iter().map(|x| *x as f64).sum::<f64>() + rest.iter().map(|x| *x as f64).sum::<f64>()
}

fn produce(_rank: usize, (q, n, count, strategy): (Queue<Option<Tensor>>, usize, usize, SharingStrategy)) {
    set_sharing_strategy(strategy).expect("strategy");
    for i in 0..count {
        q.put(Some(fresh(n, i as f32).expect("producer: alloc"))).expect("producer: put");
    }
    q.put(None).expect("producer: put");
}

fn stream(size: usize, count: usize, strategy: SharingStrategy) -> Result<Figures, String> {
    let n = (size / 4).max(1);
    let q: Queue<Option<Tensor>> = Queue::with_capacity(4).map_err(err)?;
    let mut ctx = spawn(produce, (q.clone(), n, count, strategy), 1).map_err(err)?;
    let mut total = 0.0;
    let mut got = 0usize;
    let mut t = q.get().map_err(err)?;
    let t0 = Instant::now();
    loop {
        if let Some(x) = &t {
            // Read in place: the zero-copy path is what is measured. SAFETY: the producer
            // filled a fresh tensor before `put` (ordered before our `get`) and kept no
            // handle; nothing writes it while it is summed.
            total += sum_f32(unsafe { x.as_slice::<f32>() }.map_err(err)?);
        }
        drop(t);
        t = q.get().map_err(err)?;
        if t.is_none() {
            break;
        }
        got += 1;
    }
    let dt = t0.elapsed().as_secs_f64();
    ctx.join(None).map_err(err)?;
    std::hint::black_box(total);
    Ok(Figures(vec![("seconds", dt), ("GBps", (size * got) as f64 / dt / 1e9), ("items", got as f64)]))
}

type BatchArgs = (Queue<Option<Vec<Tensor>>>, usize, usize, usize, SharingStrategy);

fn produce_batches(_rank: usize, (q, n, k, count, strategy): BatchArgs) {
    set_sharing_strategy(strategy).expect("strategy");
    for i in 0..count {
        let b: Vec<Tensor> = (0..k).map(|_| fresh(n, i as f32).expect("producer: alloc")).collect();
        q.put(Some(b)).expect("producer: put");
    }
    q.put(None).expect("producer: put");
}

fn batch(size: usize, k: usize, count: usize, strategy: SharingStrategy) -> Result<Figures, String> {
    let n = (size / 4).max(1);
    let q: Queue<Option<Vec<Tensor>>> = Queue::with_capacity(4).map_err(err)?;
    let mut ctx = spawn(produce_batches, (q.clone(), n, k, count, strategy), 1).map_err(err)?;
    let mut got = 0usize;
    let mut b = q.get().map_err(err)?;
    let t0 = Instant::now();
    loop {
        drop(b);
        b = q.get().map_err(err)?;
        match &b {
            None => break,
            Some(v) => got += v.len(),
        }
    }
    let dt = t0.elapsed().as_secs_f64();
    ctx.join(None).map_err(err)?;
    Ok(Figures(vec![
        ("seconds", dt),
        ("tensors_per_s", got as f64 / dt),
        ("messages_per_s", got as f64 / k as f64 / dt),
    ]))
}

fn nothing(_rank: usize, _: ()) {}

fn spawn_workers(n: usize) -> Result<Figures, String> {
    let t0 = Instant::now();
    let mut ctx = spawn(nothing, (), n).map_err(err)?;
    ctx.join(None).map_err(err)?;
    Ok(Figures(vec![("seconds", t0.elapsed().as_secs_f64())]))
}

/// The JSON line, keys as torch_baseline.py prints them (each the median over the runs), and
/// `runs` with each key's `_min` and `_max` when there was more than one.
pub fn json_line(w: &Workload, strategy: SharingStrategy, f: &Summary) -> String {
    let args: Vec<String> =
        w.args.iter().map(|a| format!("\"{}\"", a.replace('\\', "\\\\").replace('"', "\\\""))).collect();
    let mut s = format!(
        "{{\"system\": \"tensorshare {}\", \"workload\": \"{}\", \"args\": [{}], \"strategy\": \"{}\"",
        env!("CARGO_PKG_VERSION"),
        w.name,
        args.join(", "),
        strategy
    );
    for x in &f.figures {
        if x.key == "items" {
            s += &format!(", \"{}\": {}", x.key, x.median as u64);
        } else {
            s += &format!(", \"{}\": {}", x.key, x.median);
        }
    }
    if f.runs > 1 {
        s += &format!(", \"runs\": {}", f.runs);
        for x in f.figures.iter().filter(|x| x.key != "items") {
            s += &format!(", \"{}_min\": {}, \"{}_max\": {}", x.key, x.min, x.key, x.max);
        }
    }
    s + "}"
}

/// One row of the table: each figure's median, and its range over the runs when there was
/// more than one.
pub fn table_row(w: &Workload, f: &Summary) -> String {
    let num = |v: f64| if v >= 1000.0 { format!("{v:.0}") } else { format!("{v:.4}") };
    let figures: Vec<String> = f
        .figures
        .iter()
        .filter(|x| x.key != "items")
        .map(|x| {
            if f.runs > 1 {
                format!("{} {} [{}..{}]", x.key, num(x.median), num(x.min), num(x.max))
            } else {
                format!("{} {}", x.key, num(x.median))
            }
        })
        .collect();
    let runs = if f.runs > 1 { format!("  (median of {})", f.runs) } else { String::new() };
    format!("{:<10} {:<22} {}{runs}", w.name, w.args.join(" "), figures.join("  "))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Zero rounds had no median to take: an index panic. Now it, and an unknown mode, are
    /// errors before any worker starts.
    #[test]
    fn pingpong_refuses_zero_rounds_and_unknown_modes() {
        let w = |args: &[&str]| Workload {
            name: "pingpong".into(),
            args: args.iter().map(|a| a.to_string()).collect(),
        };
        let e = run(&w(&["4096", "0", "fresh"]), SharingStrategy::FileDescriptor).err().unwrap();
        assert!(e.contains("ROUNDS must be at least 1"), "{e}");
        let e = run(&w(&["4096", "10", "sometimes"]), SharingStrategy::FileDescriptor).err().unwrap();
        assert!(e.contains("mode must be fresh or same"), "{e}");
    }

    #[test]
    fn summaries_give_the_median_and_the_range_of_each_figure() {
        let runs = [
            Figures(vec![("median_us", 9.0), ("p99_us", 30.0)]),
            Figures(vec![("median_us", 7.0), ("p99_us", 60.0)]),
            Figures(vec![("median_us", 60.0), ("p99_us", 31.0)]),
            Figures(vec![("median_us", 8.0), ("p99_us", 29.0)]),
        ];
        let s = summarise(&runs);
        assert_eq!(s.runs, 4);
        let m = &s.figures[0];
        assert_eq!((m.key, m.median, m.min, m.max), ("median_us", 8.5, 7.0, 60.0));
        let p = &s.figures[1];
        assert_eq!((p.key, p.median, p.min, p.max), ("p99_us", 30.5, 29.0, 60.0));
        let one = summarise(&runs[..1]);
        assert_eq!((one.runs, one.figures[0].median), (1, 9.0));
        let w = Workload { name: "pingpong".into(), args: vec!["4096".into()] };
        assert!(table_row(&w, &s).contains("median_us 8.5000 [7.0000..60.0000]"), "{}", table_row(&w, &s));
        let j = json_line(&w, SharingStrategy::FileDescriptor, &s);
        assert!(
            j.contains("\"median_us\": 8.5, ")
                && j.contains("\"runs\": 4")
                && j.contains("\"median_us_max\": 60"),
            "{j}"
        );
    }
}
