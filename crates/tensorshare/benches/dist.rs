//! `tensorshare::dist` against plain MPI and torch.distributed (gloo), in one run:
//! `all_reduce` (sum) of 4 KiB, 1 MiB and 64 MiB of f32 across 4 ranks on this node, and a
//! send/recv pingpong of 4 KiB and 64 MiB between 2 ranks.
//!
//! `cargo bench -p tensorshare --features mpi --bench dist` starts `mpirun` on this very
//! binary (`--rank-job allreduce|pingpong`) and on `benches/dist/gloo_allreduce.py`, then
//! prints one table. Every figure is the median, over 10 runs, of the time per operation
//! of the slowest rank (each run: a barrier, then a burst of operations), with the range of
//! the runs; a pingpong figure is one way (a round trip / 2). MPI works on private buffers
//! of the same size (`MPI_Allreduce` into a second buffer; `MPI_Send`/`MPI_Recv` of the
//! buffer); tensorshare on one tensor, which its first operation moves into shared memory.
//! Buffers hold zeros (sums stay finite). `TENSORSHARE_PYTHON` names a Python with torch
//! (default: `~/.cache/tensorshare/venv/bin/python`); without one, gloo's column is empty.

use std::process::Command;
use std::time::Instant;

use tensorshare::dist::{self, ReduceOp};
use tensorshare::raw::mpi;
use tensorshare::{DType, Tensor};

use mpi::collective::{CommunicatorCollectives, SystemOperation};
use mpi::point_to_point::{Destination, Source};
use mpi::topology::{Communicator, SimpleCommunicator};

const RUNS: usize = 10;
/// f32 elements, and operations per run, for all_reduce.
const ALL_REDUCE: [(usize, usize); 3] = [(1024, 400), (256 * 1024, 20), (16 << 20, 3)];
/// f32 elements, and round trips per run, for the pingpong.
const PINGPONG: [(usize, usize); 2] = [(1024, 2000), (16 << 20, 10)];

fn main() {
    tensorshare::init();
    let args: Vec<String> = std::env::args().collect();
    if let Some(k) = args.iter().position(|a| a == "--rank-job") {
        let job = args.get(k + 1).cloned().unwrap_or_default();
        let _session = dist::init().expect("dist::init");
        match job.as_str() {
            "allreduce" => all_reduce_job(),
            "pingpong" => pingpong_job(),
            other => panic!("no job {other}"),
        }
        return;
    }
    launcher();
}

/// The median, min and max of `runs`, in µs.
fn stats(mut runs: Vec<f64>) -> (f64, f64, f64) {
    runs.sort_by(f64::total_cmp);
    (runs[runs.len() / 2], runs[0], runs[runs.len() - 1])
}

/// The slowest rank's time, in µs.
fn slowest(us: f64) -> f64 {
    let mut t = Tensor::full(&[1], us);
    dist::all_reduce(&mut t, ReduceOp::Max).expect("all_reduce of the times");
    t.to_vec::<f64>().expect("times")[0]
}

/// Runs of `ops` calls of `f`, each run timed on every rank after a barrier.
fn measure(ops: usize, mut f: impl FnMut()) -> (f64, f64, f64) {
    for _ in 0..ops.min(5) {
        f(); // warm: arenas made, pages touched, connections up
    }
    let runs = (0..RUNS)
        .map(|_| {
            dist::barrier().expect("barrier");
            let t0 = Instant::now();
            for _ in 0..ops {
                f();
            }
            slowest(t0.elapsed().as_secs_f64() * 1e6 / ops as f64)
        })
        .collect();
    stats(runs)
}

fn report(workload: &str, who: &str, bytes: usize, (median, lo, hi): (f64, f64, f64)) {
    if dist::rank().expect("rank") == 0 {
        println!("RESULT {workload} {who} {bytes} {median:.2} {lo:.2} {hi:.2}");
    }
}

fn all_reduce_job() {
    let world = SimpleCommunicator::world();
    for (n, ops) in ALL_REDUCE {
        let mut t = Tensor::full(&[n], 1.0f32);
        dist::all_reduce(&mut t, ReduceOp::Sum).expect("all_reduce");
        let want = dist::world_size().expect("size") as f32;
        assert!(t.to_vec::<f32>().expect("values").iter().all(|&v| v == want), "a wrong sum");
        t.fill(0.0f32).expect("fill");
        let figure = measure(ops, || dist::all_reduce(&mut t, ReduceOp::Sum).expect("all_reduce"));
        report("allreduce", "tensorshare", n * 4, figure);
        let send = vec![0.0f32; n];
        let mut recv = vec![0.0f32; n];
        let figure = measure(ops, || world.all_reduce_into(&send[..], &mut recv[..], SystemOperation::sum()));
        report("allreduce", "mpi", n * 4, figure);
    }
}

fn pingpong_job() {
    let world = SimpleCommunicator::world();
    let rank = dist::rank().expect("rank");
    let other = 1 - rank;
    for (n, rounds) in PINGPONG {
        let mut t = Tensor::zeros(&[n], DType::F32);
        t.share_memory().expect("share");
        let (median, lo, hi) = measure(rounds, || {
            if rank == 0 {
                dist::send(&t, other).expect("send");
                t = dist::recv(other).expect("recv");
            } else {
                t = dist::recv(other).expect("recv");
                dist::send(&t, other).expect("send");
            }
        });
        report("pingpong", "tensorshare", n * 4, (median / 2.0, lo / 2.0, hi / 2.0));
        let mut buf = vec![0.0f32; n];
        let peer = world.process_at_rank(other as i32);
        let (median, lo, hi) = measure(rounds, || {
            if rank == 0 {
                peer.send(&buf[..]);
                peer.receive_into(&mut buf[..]);
            } else {
                peer.receive_into(&mut buf[..]);
                peer.send(&buf[..]);
            }
        });
        report("pingpong", "mpi", n * 4, (median / 2.0, lo / 2.0, hi / 2.0));
    }
}

/// `program args...` under `mpirun -np ranks`; the RESULT lines of its output.
fn mpirun(ranks: usize, program: &str, args: &[&str], env: &[(&str, String)]) -> Vec<String> {
    let mut cmd = Command::new(std::env::var("MPIRUN").unwrap_or_else(|_| "mpirun".into()));
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        cmd.env("OMPI_ALLOW_RUN_AS_ROOT", "1").env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1");
    }
    cmd.args(["--oversubscribe", "-np", &ranks.to_string()]);
    for (k, v) in env {
        cmd.env(k, v).args(["-x", k]);
    }
    let out = cmd.arg(program).args(args).output().expect("run mpirun");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    if !out.status.success() {
        eprintln!(
            "{program} {args:?} failed: {}\n{text}{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    text.lines().filter(|l| l.starts_with("RESULT ")).map(str::to_owned).collect()
}

fn python() -> Option<String> {
    if let Ok(p) = std::env::var("TENSORSHARE_PYTHON") {
        return Some(p);
    }
    let home = std::env::var("HOME").ok()?;
    let p = format!("{home}/.cache/tensorshare/venv/bin/python");
    std::path::Path::new(&p).exists().then_some(p)
}

fn launcher() {
    let exe = std::env::current_exe().expect("this binary").display().to_string();
    let mut results = mpirun(4, &exe, &["--rank-job", "allreduce"], &[]);
    results.extend(mpirun(2, &exe, &["--rank-job", "pingpong"], &[]));
    match python() {
        Some(py) => {
            let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../../benches/dist/gloo_allreduce.py");
            let port =
                std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port());
            let port = port.expect("a free port").to_string();
            results.extend(mpirun(4, &py, &[script], &[("TENSORSHARE_GLOO_PORT", port)]));
        }
        None => eprintln!("gloo: no Python with torch (set TENSORSHARE_PYTHON): its column stays empty"),
    }
    table(&results);
}

/// `RESULT workload who bytes median min max` lines as a Markdown table.
fn table(results: &[String]) {
    let find = |workload: &str, who: &str, bytes: usize| -> Option<(f64, f64, f64)> {
        results.iter().find_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            if f.len() != 7 || f[1] != workload || f[2] != who || f[3] != bytes.to_string() {
                return None;
            }
            Some((f[4].parse().ok()?, f[5].parse().ok()?, f[6].parse().ok()?))
        })
    };
    let cell = |v: Option<(f64, f64, f64)>| {
        v.map_or("-".into(), |(m, lo, hi)| format!("{} ({}..{})", fig(m), fig(lo), fig(hi)))
    };
    let ratio = |a: Option<(f64, f64, f64)>, b: Option<(f64, f64, f64)>| match (a, b) {
        (Some((a, ..)), Some((b, ..))) => format!("{:.1}x", b / a),
        _ => "-".into(),
    };
    println!("\n| all_reduce, 4 ranks | tensorshare µs | MPI_Allreduce µs | gloo µs | vs MPI | vs gloo |");
    println!("|---|---:|---:|---:|---:|---:|");
    for (n, _) in ALL_REDUCE {
        let (t, m, g) = (
            find("allreduce", "tensorshare", n * 4),
            find("allreduce", "mpi", n * 4),
            find("allreduce", "gloo", n * 4),
        );
        println!(
            "| {} f32 | {} | {} | {} | {} | {} |",
            size(n * 4),
            cell(t),
            cell(m),
            cell(g),
            ratio(t, m),
            ratio(t, g)
        );
    }
    println!("\n| pingpong, 2 ranks, one way | tensorshare µs | MPI send/recv µs | vs MPI |");
    println!("|---|---:|---:|---:|");
    for (n, _) in PINGPONG {
        let (t, m) = (find("pingpong", "tensorshare", n * 4), find("pingpong", "mpi", n * 4));
        println!("| {} | {} | {} | {} |", size(n * 4), cell(t), cell(m), ratio(t, m));
    }
}

fn size(bytes: usize) -> String {
    match bytes {
        b if b >= 1 << 20 => format!("{} MiB", b >> 20),
        b => format!("{} KiB", b >> 10),
    }
}

fn fig(us: f64) -> String {
    match us {
        u if u >= 1000.0 => format!("{:.0}", u),
        u if u >= 100.0 => format!("{u:.0}"),
        u => format!("{u:.1}"),
    }
}
