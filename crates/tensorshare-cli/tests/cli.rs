//! The `tensorshare` command as a user runs it.

use std::process::Command;

fn tensorshare(args: &[&str], env: &[(&str, &str)]) -> (bool, String, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tensorshare"));
    cmd.args(args).env_remove("TENSORSHARE_SHARING_STRATEGY");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("run tensorshare");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into(),
        String::from_utf8_lossy(&out.stderr).into(),
    )
}

#[test]
fn info_shows_the_strategy_the_environment_chose() {
    let (ok, out, _) = tensorshare(&["info"], &[]);
    assert!(ok);
    assert!(out.contains("file_descriptor (current)"), "{out}");
    assert!(out.contains("descriptor limit"), "{out}");
    let (ok, out, _) = tensorshare(&["info"], &[("TENSORSHARE_SHARING_STRATEGY", "file_system")]);
    assert!(ok);
    assert!(out.contains("file_system (current)"), "{out}");
    let (ok, out, err) = tensorshare(&["info"], &[("TENSORSHARE_SHARING_STRATEGY", "bogus")]);
    assert!(ok);
    assert!(out.contains("file_descriptor (current)"), "{out}");
    assert!(err.contains("ignoring TENSORSHARE_SHARING_STRATEGY"), "{err}");
}

#[test]
fn bench_prints_the_keys_of_the_torch_baseline() {
    let (ok, out, err) = tensorshare(&["bench", "--json", "spawn", "2"], &[]);
    assert!(ok, "{err}");
    for key in [
        "\"system\": \"tensorshare",
        "\"workload\": \"spawn\"",
        "\"args\": [\"2\"]",
        "\"strategy\": \"file_descriptor\"",
        "\"seconds\": ",
    ] {
        assert!(out.contains(key), "{key} missing in {out}");
    }
    let (ok, out, err) =
        tensorshare(&["bench", "--json", "--strategy", "file_system", "pingpong", "4096", "20", "same"], &[]);
    assert!(ok, "{err}");
    assert!(
        out.contains("\"median_us\": ") && out.contains("\"p99_us\": ") && out.contains("file_system"),
        "{out}"
    );
    let (ok, out, err) = tensorshare(&["bench", "batch", "1024", "10", "5"], &[]);
    assert!(ok, "{err}");
    assert!(out.contains("tensors_per_s") && out.contains("(median of 10)"), "{out}");
}

/// Every figure is the median of the runs, with the runs' range beside it.
#[test]
fn bench_reports_the_median_and_range_over_its_runs() {
    let (ok, out, err) = tensorshare(&["bench", "--json", "--runs", "3", "spawn", "1"], &[]);
    assert!(ok, "{err}");
    let num = |key: &str| -> f64 {
        let at = out.find(&format!("\"{key}\": ")).unwrap_or_else(|| panic!("{key} missing in {out}"));
        let rest = &out[at + key.len() + 4..];
        rest[..rest.find([',', '}']).expect("a value")].trim().parse().expect("a number")
    };
    assert_eq!(num("runs"), 3.0);
    let (min, median, max) = (num("seconds_min"), num("seconds"), num("seconds_max"));
    assert!(min > 0.0 && min <= median && median <= max, "{out}");
    let (ok, _, err) = tensorshare(&["bench", "--runs", "0", "spawn", "1"], &[]);
    assert!(!ok && err.contains("--runs"), "{err}");
}

#[test]
fn bench_rejects_bad_workloads_with_a_message() {
    let (ok, _, err) = tensorshare(&["bench", "pingpong", "4096", "10", "sideways"], &[]);
    assert!(!ok);
    assert!(err.contains("fresh or same"), "{err}");
    let (ok, _, err) = tensorshare(&["bench", "teleport"], &[]);
    assert!(!ok);
    assert!(err.contains("unknown workload"), "{err}");
}

#[test]
fn demo_checks_every_batch_both_ways() {
    let (ok, out, err) =
        tensorshare(&["demo", "--workers", "2", "--batches", "12", "--batch-size", "4", "--side", "16"], &[]);
    assert!(ok, "{err}");
    assert!(
        out.contains("every batch checked: 12 of 12 through shared memory, 12 through the pipe"),
        "{out}"
    );
    assert!(out.contains("batches/s") && out.contains("latency p99"), "{out}");
}

/// `shm ls` and `shm gc` on a planted segment of a dead group, beside a live group's
/// segment that gc must leave alone.
#[test]
fn shm_ls_and_gc_remove_only_dead_groups() {
    use tensorshare::{DType, SharingStrategy, Tensor};
    let live = Tensor::empty_shared_with(&[1024], DType::F32, SharingStrategy::FileSystem).unwrap();
    let live_name = live.storage().segment_name().unwrap();
    // A root pid with no process: above pid_max, or not in /proc.
    let dead = (0..1000)
        .map(|i| 4_194_000 - i)
        .find(|p| !std::path::Path::new(&format!("/proc/{p}")).exists())
        .unwrap();
    let planted = format!("tensorshare_{dead}_{dead}_00000000deadbeef");
    let dir = tensorshare::segments::shm_dir();
    std::fs::write(dir.join(&planted), vec![0u8; 4096]).unwrap();

    let (ok, out, err) = tensorshare(&["shm", "ls"], &[]);
    assert!(ok, "{err}");
    let line = out.lines().find(|l| l.contains(&planted)).unwrap_or_else(|| panic!("{out}"));
    assert!(line.contains("dead") && line.contains(&dead.to_string()), "{line}");
    let live_line = out.lines().find(|l| l.contains(&live_name)).unwrap_or_else(|| panic!("{out}"));
    assert!(live_line.contains("alive"), "{live_line}");

    let (ok, out, _) = tensorshare(&["shm", "gc", "--dry-run"], &[]);
    assert!(ok);
    assert!(out.contains(&format!("would remove {planted}")), "{out}");
    assert!(dir.join(&planted).exists(), "--dry-run removes nothing");

    let (ok, out, _) = tensorshare(&["shm", "gc"], &[]);
    assert!(ok);
    assert!(out.contains(&format!("removed {planted}")), "{out}");
    assert!(!dir.join(&planted).exists());
    assert!(dir.join(&live_name).exists(), "a live group's segment stays");
    assert_eq!(live.to_vec::<f32>().unwrap().len(), 1024);
}

#[test]
fn shm_commands_fail_with_a_message_on_a_missing_directory() {
    let (ok, _, err) = tensorshare(&["shm", "ls"], &[("TENSORSHARE_SHM_DIR", "/nonexistent/tensorshare")]);
    assert!(!ok);
    assert!(err.contains("/nonexistent/tensorshare"), "{err}");
}

/// Runs `command` in a private mount namespace whose directory `dir` is a fresh 64 MiB
/// tmpfs (Docker's default /dev/shm), or says why it cannot (not root, no `unshare`).
fn in_64_mib_shm(command: &str) -> Option<std::process::Output> {
    let dir =
        std::env::temp_dir().join(format!("tensorshare-shm64-{}-{}", std::process::id(), command.len()));
    std::fs::create_dir_all(&dir).unwrap();
    let mount = format!("mount -t tmpfs -o size=64m tensorshare-test {}", dir.display());
    let probe = Command::new("unshare").args(["-m", "sh", "-c", &mount]).output();
    let out = match probe {
        Ok(p) if p.status.success() => {
            let script = format!("{mount} && TENSORSHARE_SHM_DIR={} exec {command}", dir.display());
            Some(Command::new("unshare").args(["-m", "sh", "-c", &script]).output().expect("run unshare"))
        }
        Ok(p) => {
            eprintln!(
                "skipped: cannot mount a tmpfs in a private namespace: {}",
                String::from_utf8_lossy(&p.stderr)
            );
            None
        }
        Err(e) => {
            eprintln!("skipped: no unshare: {e}");
            None
        }
    };
    std::fs::remove_dir(&dir).unwrap();
    out
}

/// The demo, and the dataloader example, with the file_system strategy in a container's
/// 64 MiB /dev/shm: the pain of torch's DataLoader users ("bus error") is not ours.
#[test]
fn the_demo_and_the_dataloader_run_in_a_64_mib_dev_shm() {
    let bin = env!("CARGO_BIN_EXE_tensorshare");
    let Some(out) = in_64_mib_shm(&format!("{bin} demo --strategy file_system --batches 60")) else { return };
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("every batch checked: 60 of 60"), "{stdout}\n{stderr}");
    // The example, built by `cargo test` beside this binary.
    let example = std::path::Path::new(bin).parent().unwrap().join("examples/dataloader");
    if !example.exists() {
        eprintln!("skipped the dataloader example: {} is not built", example.display());
        return;
    }
    let command = format!("env TENSORSHARE_SHARING_STRATEGY=file_system {}", example.display());
    let Some(out) = in_64_mib_shm(&command) else { return };
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{stdout}\n{stderr}");
}

/// With the file_descriptor strategy nothing is made in the shared-memory directory, so
/// workers start where it is read-only or missing (it used to hold the cleanup group's lock).
#[test]
fn workers_start_without_a_usable_shared_memory_directory() {
    let (ok, out, err) = tensorshare(
        &["bench", "--json", "spawn", "2"],
        &[("TENSORSHARE_SHM_DIR", "/nonexistent/tensorshare-shm")],
    );
    assert!(ok, "{out}\n{err}");
    assert!(out.contains("\"workload\": \"spawn\""), "{out}");
}
