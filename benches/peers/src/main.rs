//! `peers`: the workloads of BENCHMARKS.md through tensorshare, ipc-channel and iceoryx2, side
//! by side in one run, each between two real processes.
//!
//! Rounds are interleaved: in every round each (workload, placement) cell runs once on every
//! system, so that drift of this shared machine reaches all systems alike; each cell reports
//! the median over the rounds with their minimum and maximum. See README.md.

mod iox;
mod ipc;
mod peer;
mod place;
mod report;
mod ts;
mod work;

use std::collections::BTreeSet;
use std::process::ExitCode;

use iox::{Files, Wait};
use place::Placement;
use report::{num, quote, summarise, verdict, Spread};
use work::{Figures, Job, Res};

/// The exact versions in Cargo.toml (pinned there so that these words stay true).
const IPC_CHANNEL_VERSION: &str = "0.20.2";
const ICEORYX2_VERSION: &str = "0.9.3";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum System {
    Tensorshare,
    IpcChannel,
    Iceoryx2(Wait),
}

impl System {
    const ALL: [System; 5] = [
        System::Tensorshare,
        System::IpcChannel,
        System::Iceoryx2(Wait::Poll),
        System::Iceoryx2(Wait::Block),
        System::Iceoryx2(Wait::Hybrid),
    ];

    fn name(self) -> String {
        match self {
            System::Tensorshare => "tensorshare".into(),
            System::IpcChannel => format!("ipc-channel {IPC_CHANNEL_VERSION}"),
            System::Iceoryx2(w) => format!("iceoryx2 {ICEORYX2_VERSION} {}", w.name()),
        }
    }
}

/// A workload of BENCHMARKS.md, without its counts (those depend on the cell: see `job`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Workload {
    PingPong { size: usize, same: bool },
    Stream { size: usize },
    Batch { size: usize, k: usize },
}

const WORKLOADS: [Workload; 6] = [
    Workload::PingPong { size: 4096, same: false },
    Workload::PingPong { size: 4096, same: true },
    Workload::PingPong { size: 1 << 20, same: false },
    Workload::PingPong { size: 1 << 20, same: true },
    Workload::Stream { size: 4096 },
    Workload::Batch { size: 1024, k: 100 },
];

impl Workload {
    fn name(self) -> &'static str {
        match self {
            Workload::PingPong { .. } => "pingpong",
            Workload::Stream { .. } => "stream",
            Workload::Batch { .. } => "batch",
        }
    }

    fn args(self) -> Vec<String> {
        match self {
            Workload::PingPong { size, same } => {
                vec![size.to_string(), if same { "same" } else { "fresh" }.into()]
            }
            Workload::Stream { size } => vec![size.to_string()],
            Workload::Batch { size, k } => vec![size.to_string(), k.to_string()],
        }
    }

    fn label(self) -> String {
        format!("{} {}", self.name(), self.args().join(" "))
    }

    /// The run of this workload on `system` in `placement`. Counts keep the whole default
    /// run within minutes on a 2-core machine and are the same for every system, except for
    /// iceoryx2 polling where its two processes may share a core (one-core, and unpinned when
    /// the scheduler puts both on one): there each hand-off waits out the spinner's time slice
    /// (milliseconds), and fewer iterations already give the steady state. `quick` divides by 10.
    fn job(self, system: System, placement: Placement, quick: bool) -> Job {
        let poll = system == System::Iceoryx2(Wait::Poll);
        let (rounds, big_rounds, warmup, items, batches) = match (poll, placement) {
            (true, Placement::OneCore) => (20, 20, 5, 400, 20),
            (true, Placement::Unpinned) => (100, 100, 20, 400, 100),
            _ => (1000, 300, 50, 5000, 100),
        };
        let q = |n: usize| if quick { (n / 10).max(5) } else { n };
        match self {
            Workload::PingPong { size, same } => Job::PingPong {
                size,
                same,
                rounds: q(if size >= 1 << 20 { big_rounds } else { rounds }),
                warmup: q(warmup),
            },
            Workload::Stream { size } => Job::Stream { size, count: q(items) },
            Workload::Batch { size, k } => Job::Batch { size, k, count: q(batches) },
        }
    }
}

struct Options {
    rounds: usize,
    quick: bool,
    json: bool,
    only: Vec<String>,
}

const USAGE: &str = "usage: peers [--rounds N] [--quick] [--json] [--only TEXT]...
  --rounds N  rounds of every cell (default 10; --quick: 2); each figure is the median
  --quick     fewer rounds and iterations: a smoke test, not a measurement
  --json      one JSON line per cell instead of the table
  --only TEXT only the workloads, placements and systems whose names contain TEXT (each
              --only narrows further), e.g. --only stream --only iceoryx2";

/// The options, or `None` when help was asked for.
fn parse(args: &[String]) -> Res<Option<Options>> {
    let mut rounds = None;
    let (mut quick, mut json, mut only) = (false, false, Vec::new());
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--rounds" => {
                let n: usize = it.next().and_then(|v| v.parse().ok()).ok_or("--rounds needs a number")?;
                if n == 0 {
                    return Err("--rounds must be at least 1".into());
                }
                rounds = Some(n);
            }
            "--quick" => quick = true,
            "--json" => json = true,
            "--only" => only.push(it.next().ok_or("--only needs a word")?.clone()),
            "-h" | "--help" => return Ok(None),
            other => return Err(format!("unknown argument {other:?}\n{USAGE}")),
        }
    }
    Ok(Some(Options { rounds: rounds.unwrap_or(if quick { 2 } else { 10 }), quick, json, only }))
}

fn main() -> ExitCode {
    // A tensorshare worker started by this program runs its job here and exits.
    tensorshare::init();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = if args.first().map(String::as_str) == Some(peer::PEER_ROLE) {
        peer_main(&args[1..])
    } else {
        parse(&args).and_then(|o| match o {
            Some(o) => bench(&o),
            None => {
                println!("{USAGE}");
                Ok(())
            }
        })
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("peers: {e}");
            ExitCode::FAILURE
        }
    }
}

/// A peer process of an ipc-channel or iceoryx2 run (see `peer::Peer::start`).
fn peer_main(args: &[String]) -> Res<()> {
    let [parent, system, rest @ ..] = args else {
        return Err(format!("peer: bad arguments {args:?}"));
    };
    peer::become_peer(parent)?;
    match system.as_str() {
        "ipc" => ipc::peer_main(rest),
        "iox" => iox::peer_main(rest),
        other => Err(format!("peer: unknown system {other:?}")),
    }
}

/// One cell's rounds on one system.
struct Cell {
    workload: Workload,
    placement: Placement,
    system: System,
    job: Job,
    rounds: Vec<Figures>,
}

fn bench(o: &Options) -> Res<()> {
    let all = place::current()?;
    let placements: Vec<Placement> = if all.is_set(0) && all.is_set(1) {
        Placement::ALL.to_vec()
    } else {
        eprintln!("peers: CPUs 0 and 1 are not both allowed here; measuring unpinned only");
        vec![Placement::Unpinned]
    };
    let files = Files::for_this_process();
    if std::path::Path::new(&files.root).exists() {
        return Err(format!("{} exists already; remove it first", files.root));
    }
    let before = leftovers::snapshot();

    let mut cells: Vec<Cell> = Vec::new();
    for &workload in &WORKLOADS {
        for &placement in &placements {
            for system in System::ALL {
                let words = format!("{} {} {}", workload.label(), placement.name(), system.name());
                if o.only.iter().all(|w| words.contains(w.as_str())) {
                    let job = workload.job(system, placement, o.quick);
                    cells.push(Cell { workload, placement, system, job, rounds: Vec::new() });
                }
            }
        }
    }
    if cells.is_empty() {
        return Err("--only left nothing to run".into());
    }
    let t0 = std::time::Instant::now();
    let run_all = |cells: &mut [Cell]| -> Res<()> {
        for r in 0..o.rounds {
            eprintln!("peers: round {}/{} ({:.0} s so far)", r + 1, o.rounds, t0.elapsed().as_secs_f64());
            for range in groups(cells) {
                let group = &mut cells[range];
                let n = group.len();
                place::pin(group[0].placement.parent_cpu(), &all)?;
                // Each round starts with another system, so that none always runs first.
                for i in 0..n {
                    let c = &mut group[(i + r) % n];
                    let child = c.placement.child_cpu();
                    let f = match c.system {
                        System::Tensorshare => ts::run(&c.job, child),
                        System::IpcChannel => ipc::run(&c.job, child),
                        System::Iceoryx2(w) => iox::run(&c.job, w, child, &files),
                    }
                    .map_err(|e| {
                        format!("{} {} {}: {e}", c.workload.label(), c.placement.name(), c.system.name())
                    })?;
                    c.rounds.push(f);
                }
            }
        }
        place::pin(None, &all)
    };
    let outcome = run_all(&mut cells);
    // Clean up whether or not every run succeeded.
    let removed = leftovers::remove_iceoryx2_files(&files);
    outcome?;
    let elapsed = t0.elapsed().as_secs_f64();

    if o.json {
        print_json(&cells, o.rounds);
    } else {
        print_table(&cells, o, elapsed);
    }
    let after = leftovers::snapshot();
    let left: Vec<&String> = after.difference(&before).collect();
    eprintln!(
        "peers: iceoryx2 left {} file(s) of this run under {} and /dev/shm/{}*, now removed{}",
        removed.len(),
        files.root,
        files.prefix,
        if removed.is_empty() { String::new() } else { format!(": {}", removed.join(" ")) }
    );
    if left.is_empty() {
        eprintln!("peers: /dev/shm and /tmp/{{iceoryx2,iox2,.tmp}}*: nothing new since the start");
    } else {
        // Other processes on the machine may have made them: names, not blame.
        eprintln!(
            "peers: new in /dev/shm and /tmp since the start (this run's or another process's): {left:?}"
        );
    }
    Ok(())
}

/// The cells of each (workload, placement), as ranges of `cells`.
fn groups(cells: &[Cell]) -> Vec<std::ops::Range<usize>> {
    let mut out: Vec<std::ops::Range<usize>> = Vec::new();
    for (i, c) in cells.iter().enumerate() {
        match out.last_mut() {
            Some(r) if cells[r.start].workload == c.workload && cells[r.start].placement == c.placement => {
                r.end = i + 1
            }
            _ => out.push(i..i + 1),
        }
    }
    out
}

/// Per cell, the spreads of its figures and tensorshare's primary figure over the peer's.
fn summaries(cells: &[Cell]) -> Vec<(&Cell, Vec<Spread>, Option<f64>)> {
    groups(cells)
        .into_iter()
        .flat_map(|range| {
            let group = &cells[range];
            let ts = group.iter().find(|c| c.system == System::Tensorshare).map(|c| summarise(&c.rounds));
            group.iter().map(move |c| {
                let s = summarise(&c.rounds);
                let ratio = match (c.system, ts.as_ref().and_then(|t| t.first()), s.first()) {
                    (System::Tensorshare, _, _) => None,
                    (_, Some(t), Some(p)) => Some(t.median / p.median),
                    _ => None,
                };
                (c, s, ratio)
            })
        })
        .collect()
}

fn iterations(job: &Job) -> String {
    match *job {
        Job::PingPong { rounds, warmup, .. } => format!("{rounds}+{warmup}"),
        Job::Stream { count, .. } => count.to_string(),
        Job::Batch { k, count, .. } => format!("{count}x{k}"),
    }
}

/// What the figures are and how the workloads map onto each system, under the heading.
const NOTES: &str = "\
pingpong: one-way µs (round trip / 2), median of the rounds' medians and of their p99s;
stream: GB/s; batch: tensors/s. iters: timed rounds + warm-up, items, or messages x tensors.
iceoryx2 cannot send a received sample on: pingpong's child copies each into a new sample, and
\"same\" copies one source buffer into a new sample every round. batch: tensorshare a Vec<Tensor>,
ipc-channel a Vec<IpcSharedMemory> (at most 64 regions per message), iceoryx2 100 samples + one wake-up.";
const _: () = assert!(ipc::MAX_REGIONS_PER_MESSAGE == 64, "NOTES quotes it");

fn print_table(cells: &[Cell], o: &Options, elapsed: f64) {
    println!(
        "peers: {} (UTC), {}; tensorshare {} against ipc-channel {IPC_CHANNEL_VERSION} and iceoryx2 {ICEORYX2_VERSION}",
        report::today(),
        report::machine(),
        env!("CARGO_PKG_VERSION"),
    );
    println!(
        "median over {} interleaved rounds [min..max]{}; {elapsed:.0} s in all",
        o.rounds,
        if o.quick { ", --quick (a smoke test, not a measurement)" } else { "" }
    );
    println!("{NOTES}");
    println!();
    println!(
        "{:<23} {:<9} {:<22} {:>10} {:>32} {:>9} {:>9} {:>8}  tensorshare",
        "workload", "placement", "system", "iters", "median [min..max]", "p99", "unit", "ts/peer"
    );
    let mut last = None;
    for (c, s, ratio) in summaries(cells) {
        let Some(primary) = s.first() else { continue };
        let key = (c.workload, c.placement);
        if last.is_some_and(|k| k != key) {
            println!();
        }
        last = Some(key);
        let p99 = s.iter().find(|x| x.key == "p99_us").map_or(String::new(), |x| num(x.median));
        let unit = match primary.key {
            "median_us" => "µs",
            "GBps" => "GB/s",
            _ => "tensors/s",
        };
        println!(
            "{:<23} {:<9} {:<22} {:>10} {:>32} {:>9} {:>9} {:>8}  {}",
            c.workload.label(),
            c.placement.name(),
            c.system.name(),
            iterations(&c.job),
            format!("{} [{}..{}]", num(primary.median), num(primary.min), num(primary.max)),
            p99,
            unit,
            ratio.map_or("-".into(), num),
            ratio.map_or(String::new(), |r| verdict(primary.key, r)),
        );
    }
}

fn print_json(cells: &[Cell], rounds: usize) {
    for (c, s, ratio) in summaries(cells) {
        let args: Vec<String> = c.workload.args().iter().map(|a| quote(a)).collect();
        let mut line = format!(
            "{{\"workload\": {}, \"args\": [{}], \"placement\": {}, \"system\": {}, \"rounds\": {rounds}, \"iterations\": {}",
            quote(c.workload.name()),
            args.join(", "),
            quote(c.placement.name()),
            quote(&c.system.name()),
            quote(&iterations(&c.job)),
        );
        for x in &s {
            line += &format!(
                ", \"{k}\": {}, \"{k}_min\": {}, \"{k}_max\": {}",
                x.median,
                x.min,
                x.max,
                k = x.key
            );
        }
        if let Some(r) = ratio {
            line += &format!(", \"tensorshare_over_this\": {r}");
        }
        println!("{line}}}");
    }
}

/// What the run may leave behind, and removing iceoryx2's own files.
mod leftovers {
    use super::*;

    /// Names in /dev/shm, and those in /tmp that iceoryx2 or ipc-channel (its one-shot
    /// server's temporary directory) would make.
    pub fn snapshot() -> BTreeSet<String> {
        let list = |dir: &str, keep: &dyn Fn(&str) -> bool| -> Vec<String> {
            std::fs::read_dir(dir)
                .map(|rd| {
                    rd.filter_map(|e| e.ok())
                        .map(|e| e.file_name().to_string_lossy().into_owned())
                        .filter(|n| keep(n))
                        .map(|n| format!("{dir}/{n}"))
                        .collect()
                })
                .unwrap_or_default()
        };
        let mut s: BTreeSet<String> = list("/dev/shm", &|_| true).into_iter().collect();
        s.extend(list("/tmp", &|n| {
            n.starts_with("iceoryx2") || n.starts_with("iox2") || n.starts_with(".tmp")
        }));
        s
    }

    /// Removes what iceoryx2 left of this program's runs (its root directory and the
    /// /dev/shm files with this program's prefix) and returns their names. iceoryx2 keeps a
    /// node counter in a segment that outlives every node by design.
    pub fn remove_iceoryx2_files(files: &Files) -> Vec<String> {
        let mut removed = Vec::new();
        if let Ok(rd) = std::fs::read_dir("/dev/shm") {
            for e in rd.filter_map(|e| e.ok()) {
                let name = e.file_name().to_string_lossy().into_owned();
                if name.starts_with(&files.prefix) && std::fs::remove_file(e.path()).is_ok() {
                    removed.push(format!("/dev/shm/{name}"));
                }
            }
        }
        let root = std::path::Path::new(&files.root);
        if root.exists() {
            let mut inside = Vec::new();
            walk(root, &mut inside);
            removed.extend(inside);
            if let Err(e) = std::fs::remove_dir_all(root) {
                eprintln!("peers: could not remove {}: {e}", files.root);
            }
        }
        removed
    }

    /// Every file (not directory) under `dir`.
    fn walk(dir: &std::path::Path, out: &mut Vec<String>) {
        if let Ok(rd) = std::fs::read_dir(dir) {
            for e in rd.filter_map(|e| e.ok()) {
                let p = e.path();
                if p.is_dir() {
                    walk(&p, out);
                } else {
                    out.push(p.display().to_string());
                }
            }
        }
    }
}
