//! A process acts as a worker, fork server or shared-memory cleaner only when a tensorshare
//! parent proves that it started it for that; the variables alone are not enough. Each
//! case starts this test binary again as "a program" (the test `as_a_program`, which calls
//! `tensorshare::init()` first, as a `main` does, and then prints a marker) with the
//! variables set and something else than a real launch at descriptor 3, and checks what
//! the program did: run its main promptly, or refuse with a clear error.

use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::process::{Command, ExitStatus, Stdio};

use rustix::net::{AddressFamily, SocketFlags, SocketType};

tensorshare::enable_test_workers!();

/// Set in the program this test file starts.
const PROGRAM_ENV: &str = "TENSORSHARE_TEST_AS_PROGRAM";
/// What the program prints once its main runs past `init`.
const MAIN_RAN: &str = "tensorshare-test: main ran past init";

const WORKER: &str = "TENSORSHARE_WORKER";
const FORKSERVER: &str = "TENSORSHARE_FORKSERVER";
const CLEANER: &str = "TENSORSHARE_SHM_CLEANER";

/// The "program": its main is this test, run alone in a process of its own.
#[test]
fn as_a_program() {
    if std::env::var_os(PROGRAM_ENV).is_none() {
        return;
    }
    tensorshare::init();
    println!("{MAIN_RAN}");
}

struct Ran {
    status: ExitStatus,
    stdout: String,
    stderr: String,
}

impl Ran {
    /// The program ran its main and ended well, saying at most one line about it.
    fn assert_ran_main(&self, case: &str) {
        assert!(
            self.status.success() && self.stdout.contains(MAIN_RAN),
            "{case}: the program did not run its main: {:?}\nstdout: {}\nstderr: {}",
            self.status,
            self.stdout,
            self.stderr
        );
        let said = self.stderr.lines().filter(|l| l.contains("tensorshare")).count();
        assert!(said <= 1, "{case}: more than one line on stderr:\n{}", self.stderr);
    }
}

/// Runs this binary as a program with `env` set and `fd3` at descriptor 3. A program still
/// running after a minute has hung: it is killed and the test fails.
fn run_as_program(env: &[(&str, String)], fd3: Option<OwnedFd>) -> Ran {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args(["as_a_program", "--exact", "--nocapture", "--test-threads=1", "-q"])
        .env(PROGRAM_ENV, "1")
        .env_remove(WORKER)
        .env_remove(FORKSERVER)
        .env_remove(CLEANER)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    if let Some(fd) = &fd3 {
        let raw = fd.as_raw_fd();
        // SAFETY: the closure runs in the child between fork and exec and only calls fcntl
        // and dup2, which are async-signal-safe; `raw` stays open until spawn returns.
        unsafe {
            cmd.pre_exec(move || {
                let r = if raw == 3 { libc::fcntl(raw, libc::F_SETFD, 0) } else { libc::dup2(raw, 3) };
                if r == -1 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    }
    let mut child = cmd.spawn().expect("start this binary as a program");
    drop(fd3);
    let pidfd = rustix::process::pidfd_open(
        rustix::process::Pid::from_raw(child.id() as i32).unwrap(),
        rustix::process::PidfdFlags::empty(),
    )
    .unwrap();
    let mut p = [rustix::event::PollFd::new(&pidfd, rustix::event::PollFlags::IN)];
    let minute = rustix::event::Timespec { tv_sec: 60, tv_nsec: 0 };
    if rustix::event::poll(&mut p, Some(&minute)).unwrap() == 0 {
        child.kill().unwrap();
        let out = child.wait_with_output().unwrap();
        panic!("the program hung (killed after a minute); stderr: {}", String::from_utf8_lossy(&out.stderr));
    }
    let out = child.wait_with_output().unwrap();
    Ran {
        status: out.status,
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

fn me() -> i32 {
    rustix::process::getpid().as_raw_nonzero().get()
}

/// A connected pair made by this test, so the peer of either end is this process, which is
/// also the parent of the programs it starts: the best forgery short of the real thing.
fn pair(kind: SocketType) -> (OwnedFd, OwnedFd) {
    rustix::net::socketpair(AddressFamily::UNIX, kind, SocketFlags::CLOEXEC, None).unwrap()
}

const TOKEN: &str = "0123456789abcdef0123456789abcdef";

fn hello(token: &str, exe: &str) -> String {
    format!("tensorshare-hello/1 token={token} exe={exe}")
}

fn queue(fd: &OwnedFd, bytes: &[u8]) {
    rustix::net::send(fd, bytes, rustix::net::SendFlags::empty()).unwrap();
}

/// The reported hang: `TENSORSHARE_WORKER=3:<ppid>` and a socket at descriptor 3 that no
/// tensorshare parent made or wrote to. The program runs its main.
#[test]
fn a_foreign_socket_at_descriptor_3_does_not_hang_a_program() {
    for var in [WORKER, FORKSERVER] {
        let (_ours, theirs) = pair(SocketType::SEQPACKET);
        run_as_program(&[(var, format!("3:{}", me()))], Some(theirs)).assert_ran_main(var);

        // The current form of the variable, but nothing queued.
        let (_ours, theirs) = pair(SocketType::SEQPACKET);
        run_as_program(&[(var, format!("3:{}:{TOKEN}", me()))], Some(theirs)).assert_ran_main(var);
    }
}

/// Whatever else is at descriptor 3, or whoever claims to be the parent, a program runs
/// its main unless every proof holds; with the variable in its current form
/// (`3:<pid>:<token>`) and in the form that older versions trusted (`3:<pid>`).
#[test]
fn a_worker_variable_without_its_proofs_is_ignored() {
    let any_exe = "0:0:0:-"; // never compared: each case fails before that
    for with_token in [true, false] {
        let v = |pid: i32| {
            let value = if with_token { format!("3:{pid}:{TOKEN}") } else { format!("3:{pid}") };
            vec![(WORKER, value)]
        };
        let case = |what: &str| format!("{what} (token in the variable: {with_token})");

        let (r, _w) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC).unwrap();
        run_as_program(&v(me()), Some(r)).assert_ran_main(&case("a pipe"));

        run_as_program(&v(me()), None).assert_ran_main(&case("nothing at descriptor 3"));

        let (ours, theirs) = pair(SocketType::STREAM);
        queue(&ours, hello(TOKEN, any_exe).as_bytes());
        run_as_program(&v(me()), Some(theirs)).assert_ran_main(&case("a stream socket"));

        let (ours, theirs) = pair(SocketType::SEQPACKET);
        queue(&ours, hello("ffffffffffffffffffffffffffffffff", any_exe).as_bytes());
        run_as_program(&v(me()), Some(theirs)).assert_ran_main(&case("a hello with another token"));

        let (ours, theirs) = pair(SocketType::SEQPACKET);
        queue(&ours, b"\x00\x01 hello?");
        run_as_program(&v(me()), Some(theirs)).assert_ran_main(&case("something else than a hello"));

        // The variable names another parent (pid 1) than the socket's maker (this test).
        let (ours, theirs) = pair(SocketType::SEQPACKET);
        queue(&ours, hello(TOKEN, any_exe).as_bytes());
        run_as_program(&v(1), Some(theirs)).assert_ran_main(&case("another parent"));
    }
}

/// `TENSORSHARE_SHM_CLEANER` used to make any program exit before `main`; without a
/// founder's proof it is ignored.
#[test]
fn a_cleaner_variable_without_its_proofs_is_ignored() {
    run_as_program(&[(CLEANER, "1".into())], None).assert_ran_main("the variable alone");
    run_as_program(&[(CLEANER, "1".into()), ("TENSORSHARE_SHM_GROUP", "2147483646".into())], None)
        .assert_ran_main("a group that does not exist");
    let (_ours, theirs) = pair(SocketType::SEQPACKET);
    run_as_program(&[(CLEANER, format!("3:{}:{TOKEN}", me()))], Some(theirs))
        .assert_ran_main("a foreign socket");
}

/// A real launch, as far as the program can tell (its parent made the socket and queued a
/// hello with the variable's token), but the hello names another executable: the worker
/// refuses with a clear error, to its parent and on stderr, and runs nothing.
#[test]
fn a_worker_of_another_executable_is_refused() {
    let (ours, theirs) = pair(SocketType::SEQPACKET);
    queue(&ours, hello(TOKEN, "1:2:3:00112233").as_bytes());
    let ran = run_as_program(&[(WORKER, format!("3:{}:{TOKEN}", me()))], Some(theirs));
    assert!(!ran.status.success(), "the worker did not fail: {:?}\n{}", ran.status, ran.stderr);
    assert!(!ran.stdout.contains(MAIN_RAN), "the worker ran main: {}", ran.stdout);
    assert!(ran.stderr.contains("different executable than its parent"), "stderr: {}", ran.stderr);
    // Its report to the parent says the same (the report is a wire message; its text is
    // plain UTF-8 inside it).
    let mut report = vec![0u8; 64 * 1024];
    let n = rustix::net::recv(&ours, &mut report[..], rustix::net::RecvFlags::DONTWAIT).map_or(0, |(n, _)| n);
    assert!(
        String::from_utf8_lossy(&report[..n]).contains("different executable than its parent"),
        "the parent was not told why: {:?}",
        String::from_utf8_lossy(&report[..n])
    );
}
