//! Model weights loaded once for many processes, against each process loading its own.
//!
//! ```sh
//! cargo run --release --example shared_weights --features safetensors
//! ```
//!
//! Writes a synthetic model of about 500 MB to a temporary `.safetensors` file, then runs
//! 4 workers twice: (a) the parent loads the file once and sends the weights to the
//! workers (one arena handle; every worker maps the same pages), (b) each worker loads the
//! file itself. Each worker runs a forward pass (a matrix-vector product per layer, read
//! through zero-copy ndarray views). For each run it prints the time from the start of
//! loading to the first worker's result, and the sum of `Pss` over all the processes
//! (`/proc/<pid>/smaps_rollup`) while the workers hold the model.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use tensorshare::ndarray::{Array1, Ix2};
use tensorshare::{safetensors, spawn, DType, Queue, Tensor, Weights};

const WORKERS: usize = 4;
const LAYERS: usize = 30;
const DIM: usize = 2048; // 30 layers of 2048 x 2048 f32: 480 MiB

#[derive(Clone, Copy, Debug)]
enum Mode {
    /// The parent loads the model once and sends it.
    Shared,
    /// Each worker loads the file itself.
    PerWorker,
}

#[derive(serde::Serialize, serde::Deserialize)]
enum Report {
    Ready,
    Result { rank: usize, output: f32 },
}

/// What a worker gets: the file's path, a queue that brings the model (or None: load it
/// from the file), a queue for its reports, and a queue that tells it to let go.
type Args = (String, Queue<Option<Weights>>, Queue<Report>, Queue<()>);

fn main() -> tensorshare::Result<()> {
    tensorshare::init();
    let dir = std::env::temp_dir().join(format!("tensorshare-shared-weights-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|source| tensorshare::Error::Io {
        context: format!("creating {}", dir.display()),
        source,
    })?;
    let path = dir.join("model.safetensors");
    let outcome = run_both(&path);
    let _ = std::fs::remove_dir_all(&dir);
    outcome
}

fn run_both(path: &Path) -> tensorshare::Result<()> {
    // A worker writes the model, so that the memory it took is gone before measuring.
    let mut writer = spawn(|_rank, path: String| write_model(Path::new(&path)), path_string(path), 1)?;
    writer.join(None)?;
    let size = std::fs::metadata(path).map(|m| m.len()).unwrap_or(0);
    println!("model: {LAYERS} layers of {DIM}x{DIM} f32, {:.0} MB in {}", size as f64 / 1e6, path.display());
    for mode in [Mode::Shared, Mode::PerWorker] {
        let (load, first, all, pss) = run(mode, path)?;
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        let load =
            load.map_or(String::new(), |d| format!(", of which {:.0} ms loading in the parent", ms(d)));
        println!(
            "{mode:?}: first result after {:.0} ms{load} (all {WORKERS} after {:.0} ms); Pss of all \
             processes while the workers hold the model: {:.0} MB = {:.2} x the model",
            ms(first),
            ms(all),
            pss as f64 / 1e6,
            pss as f64 / size as f64
        );
        tensorshare::trim_arenas();
    }
    Ok(())
}

fn path_string(path: &Path) -> String {
    path.to_string_lossy().into_owned()
}

/// The synthetic model: deterministic small weights, filled in place (the tensors are
/// exclusive: nothing else can reach them yet), then saved.
fn write_model(path: &Path) -> tensorshare::Result<()> {
    let mut layers = Vec::with_capacity(LAYERS);
    for k in 0..LAYERS {
        let mut t = Tensor::zeros(&[DIM, DIM], DType::F32);
        for (i, v) in t.exclusive_slice_mut::<f32>()?.iter_mut().enumerate() {
            *v = ((i.wrapping_mul(2_654_435_761) ^ k) % 1000) as f32 / (500.0 * DIM as f32);
        }
        layers.push((format!("layers.{k}.weight"), t));
    }
    safetensors::save(path, layers.iter().map(|(n, t)| (n, t)))
}

/// A forward pass: x <- W x for every layer, starting from ones.
fn forward(w: &Weights) -> tensorshare::Result<f32> {
    let mut x = Array1::<f32>::ones(DIM);
    for k in 0..LAYERS {
        let t = w.get(&format!("layers.{k}.weight")).expect("every layer is in the file");
        // SAFETY: nothing writes the weights once they are loaded: every process of this
        // program only reads them.
        let m = unsafe { t.view_dim::<f32, Ix2>()? };
        x = m.dot(&x);
    }
    Ok(x[0])
}

/// Runs the workers in `mode`; returns the time the parent took to load the model (if it
/// did), to the first result, to all results, and the Pss of all processes while the
/// workers hold the model.
fn run(mode: Mode, path: &Path) -> tensorshare::Result<(Option<Duration>, Duration, Duration, u64)> {
    let model_q: Queue<Option<Weights>> = Queue::new()?;
    let report: Queue<Report> = Queue::new()?;
    let done: Queue<()> = Queue::new()?;
    let go = model_q.clone();
    let mut ctx = spawn(
        |rank, (path, model_q, report, done): Args| -> tensorshare::Result<()> {
            report.put(Report::Ready)?;
            // The model, or (None) the signal to load it.
            let w = match model_q.get()? {
                Some(w) => w,
                None => safetensors::load(&path)?,
            };
            report.put(Report::Result { rank, output: forward(&w)? })?;
            done.get()?; // hold the model until the parent has measured
            Ok(())
        },
        (path_string(path), model_q, report.clone(), done.clone()),
        WORKERS,
    )?;
    for _ in 0..WORKERS {
        report.get()?; // Ready
    }
    let pids: Vec<i32> = std::iter::once(std::process::id() as i32).chain(ctx.pids()).collect();

    let start = Instant::now();
    let parent_copy: Option<Weights> = match mode {
        Mode::Shared => Some(safetensors::load(path)?),
        Mode::PerWorker => None,
    };
    let load = parent_copy.as_ref().map(|_| start.elapsed());
    for _ in 0..WORKERS {
        go.put(parent_copy.clone())?;
    }
    let mut first = None;
    let mut outputs = Vec::new();
    for _ in 0..WORKERS {
        if let Report::Result { rank, output } = report.get()? {
            first.get_or_insert_with(|| start.elapsed());
            outputs.push((rank, output));
        }
    }
    let all = start.elapsed();
    let pss = pids.iter().map(|&p| pss(p)).sum();
    assert!(outputs.windows(2).all(|p| p[0].1 == p[1].1), "every worker computes the same: {outputs:?}");
    for _ in 0..WORKERS {
        done.put(())?;
    }
    ctx.join(None)?;
    Ok((load, first.unwrap_or(all), all, pss))
}

/// The proportional set size of a process, in bytes (`Pss` of `/proc/<pid>/smaps_rollup`).
fn pss(pid: i32) -> u64 {
    let text =
        std::fs::read_to_string(PathBuf::from(format!("/proc/{pid}/smaps_rollup"))).unwrap_or_default();
    let kb = text
        .lines()
        .find_map(|l| l.strip_prefix("Pss:"))
        .and_then(|v| v.trim().strip_suffix("kB"))
        .and_then(|v| v.trim().parse::<u64>().ok());
    kb.unwrap_or(0) * 1024
}
