//! Model weights loaded once and shared by real worker processes: every worker maps the
//! same pages of one arena, so the model is in memory once, not once per process.
#![cfg(feature = "safetensors")]

use std::io::Write;
use std::path::Path;
use std::time::Duration;

use common::TempDir;
use tensorshare::{safetensors, spawn, Queue, SharingStrategy, Weights};

tensorshare::enable_test_workers!();

#[macro_use]
mod common;

/// Long enough for a loaded machine, short enough that a lost worker fails the test.
const PATIENCE: Duration = Duration::from_secs(300);

/// Element `i` of tensor `k` of the test models: exact in f32.
fn value(k: usize, i: usize) -> f32 {
    ((k * 1_000_003 + i) % 65_536) as f32
}

/// Writes a safetensors file of `n` f32 tensors `layer{k}` of `rows x cols`, a row at a
/// time (the test's own writer: no model-sized buffer in this process).
fn write_model(path: &Path, n: usize, rows: usize, cols: usize) {
    let len = rows * cols * 4;
    let entries: Vec<String> = (0..n)
        .map(|k| {
            let (s, e) = (k * len, (k + 1) * len);
            format!(r#""layer{k}":{{"dtype":"F32","shape":[{rows},{cols}],"data_offsets":[{s},{e}]}}"#)
        })
        .collect();
    let json = format!(r#"{{"__metadata__":{{"format":"pt"}},{}}}"#, entries.join(","));
    let mut f = std::io::BufWriter::new(std::fs::File::create(path).unwrap());
    f.write_all(&(json.len() as u64).to_le_bytes()).unwrap();
    f.write_all(json.as_bytes()).unwrap();
    for k in 0..n {
        for r in 0..rows {
            let row: Vec<u8> = (0..cols).flat_map(|c| value(k, r * cols + c).to_le_bytes()).collect();
            f.write_all(&row).unwrap();
        }
    }
    f.flush().unwrap();
}

/// Whether `w` holds `write_model`'s values, all views of one shared storage. With
/// `every_element` false it reads the first and last row and column of each tensor: a
/// sample that still touches every page of the model (a row is 4 KiB in the big model).
fn holds_the_model(w: &Weights, n: usize, every_element: bool) -> bool {
    let rows_match = |k: usize, t: &tensorshare::Tensor, r: usize, len: usize| {
        let cols = t.shape()[1];
        let v = t.narrow(0, r, len).unwrap().to_vec::<f32>().unwrap();
        v.iter().enumerate().all(|(i, x)| *x == value(k, r * cols + i))
    };
    w.len() == n
        && w.storage().is_shared()
        && w.iter().enumerate().all(|(k, (name, t))| {
            let (rows, cols) = (t.shape()[0], t.shape()[1]);
            let column_matches = |c: usize| {
                let v = t.narrow(1, c, 1).unwrap().to_vec::<f32>().unwrap();
                v.iter().enumerate().all(|(r, x)| *x == value(k, r * cols + c))
            };
            name == format!("layer{k}")
                && t.storage().ptr_eq(w.storage())
                && if every_element {
                    rows_match(k, t, 0, rows)
                } else {
                    rows_match(k, t, 0, 1)
                        && rows_match(k, t, rows - 1, 1)
                        && column_matches(0)
                        && column_matches(cols - 1)
                }
        })
}

/// The mapping of this process that holds address `ptr`: its device and inode, which name
/// the arena's file the same way in every process.
fn mapping_of(ptr: usize) -> String {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    for line in maps.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        let (lo, hi) = f[0].split_once('-').unwrap();
        let (lo, hi) = (usize::from_str_radix(lo, 16).unwrap(), usize::from_str_radix(hi, 16).unwrap());
        if (lo..hi).contains(&ptr) {
            return format!("{} {}", f[3], f[4]);
        }
    }
    panic!("no mapping holds {ptr:#x}");
}

/// A `Pss:` line's kilobytes, as bytes.
fn pss_bytes(line: &str) -> Option<u64> {
    let kb = line.strip_prefix("Pss:")?.trim().strip_suffix("kB")?.trim();
    Some(kb.parse::<u64>().ok()? * 1024)
}

/// The proportional set size of process `pid`, all mappings (`smaps_rollup`).
fn pss_total(pid: i32) -> u64 {
    let text = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).unwrap();
    text.lines().find_map(pss_bytes).expect("a Pss line")
}

/// The proportional set size of the mappings of process `pid` that map the file `mapping`
/// (device and inode, as `mapping_of` names it).
fn pss_of_mapping(pid: i32, mapping: &str) -> u64 {
    let text = std::fs::read_to_string(format!("/proc/{pid}/smaps")).unwrap();
    let mut inside = false;
    let mut sum = 0;
    for line in text.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.first().is_some_and(|a| a.contains('-') && a.chars().all(|c| c.is_ascii_hexdigit() || c == '-'))
        {
            inside = f.len() >= 5 && format!("{} {}", f[3], f[4]) == mapping;
        } else if inside {
            sum += pss_bytes(line).unwrap_or(0);
        }
    }
    sum
}

#[derive(serde::Serialize, serde::Deserialize, Debug)]
enum Report {
    /// Started, and waiting for the model.
    Ready,
    /// Holding the model: whether its values are right, the data's address here, and the
    /// arena's file.
    Holding { rank: usize, ok: bool, data_ptr: usize, mapping: String },
}

const WORKERS: usize = 4;
const TENSORS: usize = 16;
const ROWS: usize = 1024;
const COLS: usize = 1024; // 16 tensors of 4 MiB: a 64 MiB model

/// Loads the model once, sends it to 4 workers, and measures while they all hold it: the
/// processes together hold about one model (Pss), not five.
fn one_model_in_memory_for_all_workers(_: ()) {
    let dir = TempDir::new("pss");
    let path = dir.path("model.safetensors");
    write_model(&path, TENSORS, ROWS, COLS);
    let model_q: Queue<Weights> = Queue::new().unwrap();
    let report: Queue<Report> = Queue::new().unwrap();
    let done: Queue<()> = Queue::new().unwrap();
    let mut ctx = spawn(
        |rank, (model_q, report, done): (Queue<Weights>, Queue<Report>, Queue<()>)| {
            report.put(Report::Ready).unwrap();
            let w = model_q.get().unwrap();
            let ok = holds_the_model(&w, TENSORS, false);
            let data_ptr = w.storage().data_ptr();
            report.put(Report::Holding { rank, ok, data_ptr, mapping: mapping_of(data_ptr) }).unwrap();
            done.get().unwrap(); // hold the model until the parent has measured
        },
        (model_q.clone(), report.clone(), done.clone()),
        WORKERS,
    )
    .unwrap();
    for _ in 0..WORKERS {
        assert!(matches!(report.get_timeout(PATIENCE).unwrap(), Report::Ready));
    }
    let pids: Vec<i32> = std::iter::once(std::process::id() as i32).chain(ctx.pids()).collect();
    let before: u64 = pids.iter().map(|&p| pss_total(p)).sum();

    let w = safetensors::load(&path).unwrap();
    let model = w.storage().len() as u64;
    assert!(model >= (TENSORS * ROWS * COLS * 4) as u64);
    let mapping = mapping_of(w.storage().data_ptr());
    for _ in 0..WORKERS {
        model_q.put(w.clone()).unwrap();
    }
    let mut ranks = Vec::new();
    for _ in 0..WORKERS {
        match report.get_timeout(PATIENCE).unwrap() {
            Report::Holding { rank, ok, data_ptr, mapping: theirs } => {
                assert!(ok, "worker {rank} read wrong values");
                assert_eq!(theirs, mapping, "worker {rank} (data at {data_ptr:#x}) maps another file");
                ranks.push(rank);
            }
            r => panic!("unexpected {r:?}"),
        }
    }
    ranks.sort();
    assert_eq!(ranks, (0..WORKERS).collect::<Vec<_>>());

    let after: u64 = pids.iter().map(|&p| pss_total(p)).sum();
    let of_model: u64 = pids.iter().map(|&p| pss_of_mapping(p, &mapping)).sum();
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    let growth = after.saturating_sub(before);
    let what = format!(
        "model {:.1} MiB; Pss of its arena in {} processes {:.1} MiB; all Pss {:.1} -> {:.1} MiB (+{:.1})",
        mib(model),
        pids.len(),
        mib(of_model),
        mib(before),
        mib(after),
        mib(growth)
    );
    eprintln!("{what}");
    assert!(of_model as f64 <= 1.05 * model as f64, "the arena is counted more than once: {what}");
    assert!(of_model as f64 >= 0.95 * model as f64, "the model's pages are not all resident: {what}");
    assert!(growth as f64 <= 1.3 * model as f64, "the processes grew by more than one model: {what}");
    assert!(growth as f64 >= 0.75 * model as f64, "the measure missed the model: {what}");

    for _ in 0..WORKERS {
        done.put(()).unwrap();
    }
    assert_eq!(ctx.join(None), Ok(true));
}

#[test]
fn one_model_in_memory_for_all_workers_checked() {
    checked!(one_model_in_memory_for_all_workers, (), ());
}

/// Weights go to a worker through a queue under each strategy, are checked there and come
/// back as the very storage they left.
fn weights_go_and_come_back(strategy: SharingStrategy) {
    tensorshare::set_sharing_strategy(strategy).unwrap();
    let dir = TempDir::new(&format!("back-{strategy}"));
    let path = dir.path("small.safetensors");
    write_model(&path, 3, 8, 16);
    let w = safetensors::load(&path).unwrap();
    assert_eq!(w.storage().sharing_strategy(), Some(strategy));
    let to: Queue<Weights> = Queue::new().unwrap();
    let from: Queue<Weights> = Queue::new().unwrap();
    let mut ctx = spawn(
        |_rank, (to, from): (Queue<Weights>, Queue<Weights>)| {
            let w = to.get().unwrap();
            assert!(holds_the_model(&w, 3, true));
            assert_eq!(w.metadata().get("format").map(String::as_str), Some("pt"));
            from.put(w).unwrap();
        },
        (to.clone(), from.clone()),
        1,
    )
    .unwrap();
    to.put(w.clone()).unwrap();
    let back = from.get_timeout(PATIENCE).unwrap();
    assert_eq!(ctx.join(None), Ok(true));
    assert!(back.storage().ptr_eq(w.storage()), "the same storage came home");
    assert!(holds_the_model(&back, 3, true));
}

#[test]
fn weights_go_and_come_back_file_descriptor() {
    checked!(weights_go_and_come_back, SharingStrategy::FileDescriptor, SharingStrategy);
}

#[test]
fn weights_go_and_come_back_file_system() {
    checked!(weights_go_and_come_back, SharingStrategy::FileSystem, SharingStrategy);
}
