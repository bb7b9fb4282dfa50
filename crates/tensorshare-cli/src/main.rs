//! The `tensorshare` command.

mod bench;
mod demo;
mod info;
mod shm;

use clap::{Parser, Subcommand};
use tensorshare::SharingStrategy;

#[derive(Parser)]
#[command(name = "tensorshare", version, about = "Tensors shared between processes without copying")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// A DataLoader-shaped pipeline: workers build batches in shared memory, the main
    /// process checks them; then the same batches through a plain pipe, for contrast.
    Demo {
        /// Worker processes (default: one per core).
        #[arg(long)]
        workers: Option<usize>,
        /// Batches in all.
        #[arg(long, default_value_t = 400)]
        batches: usize,
        /// Images per batch.
        #[arg(long, default_value_t = 64)]
        batch_size: usize,
        /// Image side in pixels (images are 3 x side x side bytes).
        #[arg(long, default_value_t = 128)]
        side: usize,
        /// Sharing strategy: file_descriptor or file_system.
        #[arg(long, default_value = "file_descriptor")]
        strategy: SharingStrategy,
    },
    /// Named shared-memory segments (file_system strategy): list them, or remove those whose
    /// processes are all gone.
    Shm {
        #[command(subcommand)]
        action: ShmAction,
    },
    /// Show the sharing strategies, the descriptor limit and the free shared memory.
    Info,
    /// Run the workloads of torch_baseline.py: pingpong SIZE ROUNDS fresh|same, stream SIZE
    /// COUNT, batch SIZE K COUNT, spawn N.
    Bench {
        /// One JSON line per workload (the keys of torch_baseline.py).
        #[arg(long)]
        json: bool,
        /// Sharing strategy: file_descriptor or file_system.
        #[arg(long, default_value = "file_descriptor")]
        strategy: SharingStrategy,
        /// Run the full table of BENCHMARKS.md.
        #[arg(long)]
        all: bool,
        /// Runs of each workload: each figure is reported as the median of the runs, with
        /// their minimum and maximum (one run on these machines can be lucky or unlucky).
        #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..))]
        runs: u32,
        /// WORKLOAD ARGS...
        workload: Vec<String>,
    },
}

#[derive(Subcommand)]
enum ShmAction {
    /// List this user's segments: name, size, creating pid, whether their group is alive.
    Ls,
    /// Remove the segments whose group has no live process.
    Gc {
        /// Show what would be removed, remove nothing.
        #[arg(long)]
        dry_run: bool,
    },
}

fn main() {
    // A worker started by this program runs its job here and exits.
    tensorshare::init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Info => info::run().map_err(|e| e.to_string()),
        Command::Shm { action: ShmAction::Ls } => shm::ls(),
        Command::Shm { action: ShmAction::Gc { dry_run } } => shm::gc(dry_run),
        Command::Demo { workers, batches, batch_size, side, strategy } => {
            let workers =
                workers.unwrap_or_else(|| std::thread::available_parallelism().map_or(2, |n| n.get()));
            demo::run(demo::Options { workers, batches, batch_size, side, strategy })
        }
        Command::Bench { json, strategy, all, runs, workload } => {
            run_bench(json, strategy, all, runs as usize, workload)
        }
    };
    if let Err(e) = result {
        eprintln!("tensorshare: {e}");
        std::process::exit(1);
    }
}

fn run_bench(
    json: bool,
    strategy: SharingStrategy,
    all: bool,
    runs: usize,
    workload: Vec<String>,
) -> Result<(), String> {
    let workloads = if all {
        bench::all()
    } else {
        let (name, args) =
            workload.split_first().ok_or("name a workload (pingpong, stream, batch, spawn) or pass --all")?;
        vec![bench::Workload { name: name.clone(), args: args.to_vec() }]
    };
    for w in &workloads {
        let f = bench::repeat(w, strategy, runs)?;
        if json {
            println!("{}", bench::json_line(w, strategy, &f));
        } else {
            println!("{}", bench::table_row(w, &f));
        }
    }
    Ok(())
}
