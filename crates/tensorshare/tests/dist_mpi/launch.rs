//! The launcher's side: `mpirun` on this binary, with a private temporary directory, a
//! time limit, and (for two nodes) two network namespaces.

use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use super::Outcome;

/// How long one `mpirun` may take before it is stopped and the test fails.
const LIMIT: Duration = Duration::from_secs(300);

/// A private directory for one run's temporary files (Open MPI's session directory, its
/// shared-memory segments), removed when dropped.
struct Scratch(PathBuf);

impl Scratch {
    fn new(tag: &str) -> Scratch {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("tensorshare-dist-{}-{n}-{tag}", std::process::id()));
        std::fs::create_dir(&dir).expect("create a private temporary directory");
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).expect("chmod 0700");
        Scratch(dir)
    }

    fn path(&self) -> &Path {
        &self.0
    }

    /// What the run left in the directory, but `ours`.
    fn leftovers(&self, ours: &[&str]) -> Vec<String> {
        fn walk(dir: &Path, base: &Path, out: &mut Vec<String>) {
            for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
                let p = e.path();
                out.push(p.strip_prefix(base).unwrap_or(&p).display().to_string());
                if p.is_dir() {
                    walk(&p, base, out);
                }
            }
        }
        let mut out = Vec::new();
        walk(&self.0, &self.0, &mut out);
        out.retain(|p| !ours.contains(&p.as_str()));
        out
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// The environment every run gets: temporary files in `scratch`, and root allowed (Open MPI
/// refuses root unless told; CI containers run as root).
fn environment(cmd: &mut Command, scratch: &Scratch) {
    cmd.env("TMPDIR", scratch.path());
    if is_root() {
        cmd.env("OMPI_ALLOW_RUN_AS_ROOT", "1").env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1");
    }
}

fn mpirun_program() -> String {
    std::env::var("MPIRUN").unwrap_or_else(|_| "mpirun".into())
}

/// `mpirun`'s own arguments for a run in `scratch`.
fn mpirun_args(scratch: &Scratch) -> Vec<String> {
    let dir = scratch.path().display().to_string();
    vec!["--mca".into(), "btl_vader_backing_directory".into(), dir]
}

fn exe() -> String {
    std::env::current_exe().expect("the test binary's path").display().to_string()
}

/// Runs `cmd` to its end, or stops it after [`LIMIT`]; its stdout, then its stderr.
fn run(mut cmd: Command) -> Result<(ExitStatus, String), String> {
    cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    let shown = format!("{cmd:?}");
    let child = cmd.spawn().map_err(|e| format!("cannot start {shown}: {e}"))?;
    let pid = child.id() as i32;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    let stop = |sig| {
        // SAFETY: kill has no memory preconditions; `pid` is the child started above,
        // not yet reaped (its waiter has not sent).
        unsafe { libc::kill(pid, sig) };
    };
    let out = match rx.recv_timeout(LIMIT) {
        Ok(out) => out.map_err(|e| format!("waiting for {shown}: {e}"))?,
        Err(_) => {
            // mpirun ends its ranks when told to end.
            stop(libc::SIGTERM);
            if rx.recv_timeout(Duration::from_secs(20)).is_err() {
                stop(libc::SIGKILL);
            }
            return Err(format!("{shown} did not end within {LIMIT:?}"));
        }
    };
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    Ok((out.status, text))
}

/// Passed when `status` is a success, every rank of `ranks` printed `rank R: ok`, and
/// `scratch` holds nothing but `ours`.
fn judge(status: ExitStatus, out: &str, ranks: usize, scratch: &Scratch, ours: &[&str]) -> Outcome {
    let missing: Vec<usize> = (0..ranks).filter(|r| !out.contains(&format!("rank {r}: ok"))).collect();
    if !status.success() || !missing.is_empty() {
        return Outcome::Failed(format!("{status}; ranks without their ok: {missing:?}\n{out}"));
    }
    let left = scratch.leftovers(ours);
    if !left.is_empty() {
        return Outcome::Failed(format!("the run left {left:?} behind\n{out}"));
    }
    Outcome::Passed
}

pub fn four_ranks_on_one_node() -> Outcome {
    let scratch = Scratch::new("node");
    let mut cmd = Command::new(mpirun_program());
    environment(&mut cmd, &scratch);
    cmd.args(mpirun_args(&scratch)).args(["--oversubscribe", "-np", "4", &exe(), "--scenario", "node"]);
    match run(cmd) {
        Ok((status, out)) => judge(status, &out, 4, &scratch, &[]),
        Err(e) => Outcome::Failed(e),
    }
}

pub fn a_job_of_one_rank_without_mpirun() -> Outcome {
    let scratch = Scratch::new("single");
    let mut cmd = Command::new(exe());
    environment(&mut cmd, &scratch);
    cmd.args(["--scenario", "single"]);
    match run(cmd) {
        Ok((status, out)) => judge(status, &out, 1, &scratch, &[]),
        Err(e) => Outcome::Failed(e),
    }
}

/// Runs `scenario` on 4 ranks with `--enable-recovery` (by default mpirun ends the job
/// when a rank dies; told to recover, it lets the others run, and they report what they
/// saw); the output, once each rank of `reports` printed its ok line with the words given.
fn recovering(scratch: &Scratch, scenario: &str, reports: &[(usize, &str)]) -> Result<String, String> {
    let mut cmd = Command::new(mpirun_program());
    environment(&mut cmd, scratch);
    cmd.args(mpirun_args(scratch)).args([
        "--oversubscribe",
        "--enable-recovery",
        "-np",
        "4",
        &exe(),
        "--scenario",
        scenario,
    ]);
    let (_, out) = run(cmd)?;
    for &(r, words) in reports {
        let Some(line) = out.lines().find(|l| l.starts_with(&format!("rank {r}: ok"))) else {
            return Err(format!("rank {r} did not report\n{out}"));
        };
        if !line.contains(words) {
            return Err(format!("rank {r} did not say {words:?}: {line}\n{out}"));
        }
    }
    Ok(out)
}

/// Runs `scenario`, in which rank 2 dies (see `recovering`); the output, once ranks 0, 1
/// and 3 each named rank 2.
fn survivors_name_rank_2(scratch: &Scratch, scenario: &str) -> Result<String, String> {
    let out = recovering(scratch, scenario, &[(0, "rank 2 (pid"), (1, "rank 2 (pid"), (3, "rank 2 (pid")])?;
    if out.contains("rank 2: ok") {
        return Err(format!("rank 2 was to die\n{out}"));
    }
    Ok(out)
}

pub fn a_rank_that_dies_is_named_by_the_others() -> Outcome {
    let scratch = Scratch::new("dies");
    let out = match survivors_name_rank_2(&scratch, "dies") {
        Ok(out) => out,
        Err(e) => return Outcome::Failed(e),
    };
    // Without that, mpirun itself ends the job at the first rank it sees end badly. That is
    // rank 2, or a survivor that noticed first: tensorshare sees the death within about
    // 50 ms, a survivor then exits with its error, and mpirun may reap that exit before it
    // reaps rank 2's. Either way the job fails and what is printed names rank 2.
    let mut cmd = Command::new(mpirun_program());
    environment(&mut cmd, &scratch);
    cmd.args(mpirun_args(&scratch)).args(["--oversubscribe", "-np", "4", &exe(), "--scenario", "dies"]);
    match run(cmd) {
        Ok((status, out)) if !status.success() && names_rank_2(&out) => {}
        Ok((status, out)) => return Outcome::Failed(format!("mpirun's own report ({status}):\n{out}")),
        Err(e) => return Outcome::Failed(e),
    }
    let left = scratch.leftovers(&[]);
    if !left.is_empty() {
        return Outcome::Failed(format!("the run left {left:?} behind\n{out}"));
    }
    Outcome::Passed
}

/// As above, but rank 2 leaves a forked child that holds its sockets and lives until the
/// job ends: the others still see rank 2's death (through its pidfd) and name it.
pub fn a_rank_that_dies_leaving_a_fork_is_named_by_the_others() -> Outcome {
    let scratch = Scratch::new("dies-fork");
    let out = survivors_name_rank_2(&scratch, "dies_leaving_a_fork");
    left_nothing(&scratch, out)
}

/// Passed once a run that went as it should (`out`) left nothing in `scratch`.
fn left_nothing(scratch: &Scratch, out: Result<String, String>) -> Outcome {
    let out = match out {
        Ok(out) => out,
        Err(e) => return Outcome::Failed(e),
    };
    let left = scratch.leftovers(&[]);
    if !left.is_empty() {
        return Outcome::Failed(format!("the run left {left:?} behind\n{out}"));
    }
    Outcome::Passed
}

/// Runs `scenario` (see `ranks::goes` and `recovering`): passed once each rank of
/// `reports` printed its ok line with the words given, and nothing was left behind.
fn goes(tag: &str, scenario: &str, reports: &[(usize, &str)]) -> Outcome {
    let scratch = Scratch::new(tag);
    let out = recovering(&scratch, scenario, reports);
    left_nothing(&scratch, out)
}

/// Rank 0 panics with values on their way to rank 1, which waits at a barrier: every other
/// rank names rank 0 (rank 0 does not wait for rank 1 to take its values).
pub fn a_rank_that_panics_with_values_on_their_way_is_named() -> Outcome {
    goes("panics", "panics", &[(1, "rank 0 (pid"), (2, "rank 0 (pid"), (3, "rank 0 (pid")])
}

/// Rank 3 ends its session with values on their way to rank 2, which keeps sending to it:
/// rank 2 names rank 3 (neither waits for the other to take its values).
pub fn a_rank_that_ends_its_session_while_another_sends_is_named() -> Outcome {
    goes("ends", "ends", &[(2, "rank 3 (pid"), (3, "ended its session")])
}

/// Whether a run in which rank 2 died says so: mpirun's own report names it, or a survivor
/// that mpirun noticed first printed the `RankGone` naming it; and no rank 2 reported ok.
fn names_rank_2(out: &str) -> bool {
    let by_mpirun = out.contains("process rank 2 ");
    let by_a_survivor = out.lines().any(|l| l.starts_with("rank ") && l.contains(": ok: saw rank 2 (pid"));
    (by_mpirun || by_a_survivor) && !out.contains("rank 2: ok")
}

/// Two network namespaces joined by a veth pair, deleted (with the pair) when dropped.
struct Namespaces {
    names: [String; 2],
}

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip").args(args).output().map_err(|e| format!("ip: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!("`ip {}`: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim()))
    }
}

impl Namespaces {
    fn create() -> Result<Namespaces, String> {
        let id = std::process::id();
        let names = [format!("tsd{id}a"), format!("tsd{id}b")];
        let mut made = Namespaces { names: [String::new(), String::new()] };
        for (k, n) in names.iter().enumerate() {
            ip(&["netns", "add", n])?;
            made.names[k] = n.clone();
        }
        let (a, b) = (&names[0], &names[1]);
        let (va, vb) = (format!("tsv{id}a"), format!("tsv{id}b"));
        ip(&["link", "add", &va, "type", "veth", "peer", "name", &vb])?;
        for (ns, dev, addr) in [(a, &va, "10.77.0.1/24"), (b, &vb, "10.77.0.2/24")] {
            ip(&["link", "set", dev, "netns", ns])?;
            ip(&["-n", ns, "addr", "add", addr, "dev", dev])?;
            ip(&["-n", ns, "link", "set", dev, "up"])?;
            ip(&["-n", ns, "link", "set", "lo", "up"])?;
        }
        Ok(made)
    }
}

impl Drop for Namespaces {
    fn drop(&mut self) {
        for n in self.names.iter().filter(|n| !n.is_empty()) {
            let _ = ip(&["netns", "del", n]);
        }
    }
}

/// Open MPI's launch agent for nodes that are network namespaces: called as ssh would be,
/// `agent HOST COMMAND...`, it runs the command in namespace HOST, under host name HOST.
const AGENT: &str =
    "#!/bin/sh\nhost=$1\nshift\nexec ip netns exec \"$host\" unshare --uts sh -c \"hostname $host && $*\"\n";

pub fn two_nodes_in_network_namespaces() -> Outcome {
    if !is_root() {
        return Outcome::Skipped(
            "two nodes in network namespaces need root (ip netns, unshare --uts)".into(),
        );
    }
    let scratch = Scratch::new("nodes");
    let net = match Namespaces::create() {
        Ok(n) => n,
        Err(why) => {
            return Outcome::Skipped(format!(
                "cannot make two network namespaces joined by a veth pair: {why}"
            ))
        }
    };
    let [a, b] = &net.names;
    let agent = scratch.path().join("agent.sh");
    let hosts = scratch.path().join("hosts");
    use std::os::unix::fs::PermissionsExt;
    let written = std::fs::write(&agent, AGENT)
        .and_then(|_| std::fs::set_permissions(&agent, std::fs::Permissions::from_mode(0o700)))
        .and_then(|_| std::fs::write(&hosts, format!("{a} slots=2\n{b} slots=2\n")));
    if let Err(e) = written {
        return Outcome::Failed(format!("writing the agent and the host file: {e}"));
    }
    // mpirun runs in the first namespace, as its host; the agent starts the second node.
    let mut cmd = Command::new("ip");
    environment(&mut cmd, &scratch);
    cmd.args(["netns", "exec", a, "unshare", "--uts", "sh", "-c", "hostname \"$0\" && exec \"$@\"", a]);
    cmd.arg(mpirun_program()).args(mpirun_args(&scratch));
    let net_only = "10.77.0.0/24";
    cmd.args(["--hostfile", &hosts.display().to_string(), "-np", "4"])
        .args(["--mca", "plm_rsh_agent", &agent.display().to_string()])
        .args(["--mca", "oob_tcp_if_include", net_only, "--mca", "btl_tcp_if_include", net_only])
        .args(["--mca", "btl", "self,vader,tcp"])
        .args([&exe(), "--scenario", "nodes"]);
    let outcome = match run(cmd) {
        Ok((status, out)) => judge(status, &out, 4, &scratch, &["agent.sh", "hosts"]),
        Err(e) => Outcome::Failed(e),
    };
    drop(net);
    outcome
}
