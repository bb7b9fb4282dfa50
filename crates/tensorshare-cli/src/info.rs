//! `tensorshare info`: what this machine offers for sharing tensors.

use tensorshare::segments::{available_bytes, shm_dir};
use tensorshare::{get_all_sharing_strategies, get_sharing_strategy};

pub fn run() -> tensorshare::Result<()> {
    let current = get_sharing_strategy();
    let all: Vec<String> = get_all_sharing_strategies()
        .into_iter()
        .map(|s| if s == current { format!("{s} (current)") } else { s.to_string() })
        .collect();
    println!("sharing strategies   {}", all.join(", "));
    let (soft, hard) = fd_limit();
    println!("descriptor limit     {soft} (hard {hard})");
    let dir = shm_dir();
    let dir_free = std::fs::File::open(dir).map(|f| available_bytes(Some(std::os::fd::AsFd::as_fd(&f))));
    match dir_free {
        Ok(b) => println!("free in {:<13} {} (file_system)", dir.display(), human(b)),
        Err(e) => println!("free in {:<13} unknown: {e}", dir.display()),
    }
    println!("free for memfd        {} (file_descriptor)", human(available_bytes(None)));
    println!("cuda                 {}", cuda());
    Ok(())
}

#[cfg(feature = "cuda")]
fn cuda() -> String {
    match (tensorshare::cuda::driver_name(), tensorshare::cuda::device_count()) {
        (Ok(driver), Ok(n)) => format!("{n} device{} ({driver} driver)", if n == 1 { "" } else { "s" }),
        (Err(e), _) | (_, Err(e)) => format!("unavailable: {e}"),
    }
}

#[cfg(not(feature = "cuda"))]
fn cuda() -> String {
    "not built (build with --features cuda)".into()
}

fn fd_limit() -> (String, String) {
    let l = rustix::process::getrlimit(rustix::process::Resource::Nofile);
    let show = |v: Option<u64>| v.map_or_else(|| "unlimited".to_string(), |v| v.to_string());
    (show(l.current), show(l.maximum))
}

pub fn human(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{bytes} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}
