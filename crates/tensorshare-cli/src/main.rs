//! The `tensorshare` command.

mod info;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "tensorshare", version, about = "Tensors shared between processes without copying")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Show the sharing strategies, the descriptor limit and the free shared memory.
    Info,
}

fn main() {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Info => info::run(),
    };
    if let Err(e) = result {
        eprintln!("tensorshare: {e}");
        std::process::exit(1);
    }
}
