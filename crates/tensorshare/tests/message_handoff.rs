//! `Message::pass_to` and `Message::from_env`: a value handed to a child process at its
//! start (its descriptors inherited, the environment naming them), and malformed handoffs
//! refused with a clear error.

use std::process::Command;
use std::time::Duration;

use tensorshare::value::{from_value, to_value};
use tensorshare::{DType, Error, Message, Queue, Tensor, Value};

const VAR: &str = "TENSORSHARE_TEST_HANDOFF";

/// The child's side: runs only when started by `a_value_passes_to_a_child_process`.
#[test]
fn handoff_child() {
    if std::env::var_os(VAR).is_none() {
        return;
    }
    let text = std::env::var(VAR).unwrap();
    let fds = text.split_once(':').unwrap().1.replace(',', " ");
    // SAFETY: the parent passed these descriptors for this message; nothing else here owns
    // them, the variable is read once, and this test runs alone in its process.
    let message = unsafe { Message::from_env(VAR) }.unwrap();
    let (q, mut t): (Queue<Value>, Tensor) = from_value(message.decode().unwrap()).unwrap();
    t.fill(7.0f32).unwrap();
    // A process this one starts sees neither the variable nor the adopted descriptors.
    let script =
        format!("printenv {VAR}; for f in {fds}; do [ -e /proc/self/fd/$f ] && echo \"fd $f\"; done; true");
    let seen = Command::new("/bin/sh").args(["-c", &script]).output().unwrap();
    let seen = String::from_utf8_lossy(&seen.stdout).into_owned();
    q.put(Value::Str(if seen.is_empty() { "filled".into() } else { seen })).unwrap();
}

#[test]
fn a_value_passes_to_a_child_process() {
    let q: Queue<Value> = Queue::new().unwrap();
    let mut t = Tensor::zeros(&[4], DType::F32);
    t.share_memory().unwrap();
    let message = Message::encode(&to_value(&(q.clone(), t.clone())).unwrap()).unwrap();
    let exe = std::env::current_exe().unwrap();
    let mut cmd = Command::new(exe);
    cmd.args(["handoff_child", "--exact", "--test-threads=1", "-q"]);
    message.pass_to(&mut cmd, VAR).unwrap();
    let status = cmd.status().unwrap();
    assert!(status.success(), "{status}");
    drop(cmd); // the message's descriptors close with it
    match q.get_timeout(Duration::from_secs(30)).unwrap() {
        Value::Str(s) => assert_eq!(s, "filled", "what the child's own child saw"),
        other => panic!("{other:?}"),
    }
    assert_eq!(t.to_vec::<f32>().unwrap(), vec![7.0; 4]);
}

const LARGE_VAR: &str = "TENSORSHARE_TEST_HANDOFF_LARGE";

/// The child's side of `a_large_value_passes_to_a_child_process_in_a_memfd`.
#[test]
fn handoff_child_large() {
    if std::env::var_os(LARGE_VAR).is_none() {
        return;
    }
    // The bytes' memfd is sealed: this child cannot change what its siblings read.
    let text = std::env::var(LARGE_VAR).unwrap();
    let n: i32 = text.strip_prefix('@').unwrap().split(':').next().unwrap().parse().unwrap();
    // SAFETY: descriptor `n` was inherited open and nothing in this process closes it before
    // `from_env` below adopts it; the borrow ends before that.
    let written = rustix::io::pwrite(unsafe { std::os::fd::BorrowedFd::borrow_raw(n) }, b"x", 0);
    // SAFETY: as in `handoff_child`.
    let message = unsafe { Message::from_env(LARGE_VAR) }.unwrap();
    let (q, paths): (Queue<Value>, Vec<String>) = from_value(message.decode().unwrap()).unwrap();
    let last = paths.last().cloned().unwrap_or_default();
    q.put(to_value(&(paths.len(), last, written.is_err())).unwrap()).unwrap();
}

#[test]
fn a_large_value_passes_to_a_child_process_in_a_memfd() {
    // Linux caps one environment string at 128 KiB: a message of 300 KB in hex made the
    // start fail with E2BIG ("Argument list too long"), naming the program.
    let q: Queue<Value> = Queue::new().unwrap();
    let paths: Vec<String> = (0..10_000).map(|i| format!("/data/train/{i:08}.jpeg")).collect();
    let message = Message::encode(&to_value(&(q.clone(), &paths)).unwrap()).unwrap();
    assert!(message.bytes().len() > 200_000, "{}", message.bytes().len());
    for _ in 0..2 {
        // Twice from one command: each child reads the bytes from the start.
        let exe = std::env::current_exe().unwrap();
        let mut cmd = Command::new(exe);
        cmd.args(["handoff_child_large", "--exact", "--test-threads=1", "-q"]);
        Message::from_parts(
            message.bytes().to_vec(),
            message.fds().iter().map(|f| f.try_clone().unwrap()).collect(),
        )
        .pass_to(&mut cmd, LARGE_VAR)
        .unwrap();
        assert!(cmd.status().unwrap().success());
        assert!(cmd.status().unwrap().success());
        for _ in 0..2 {
            let got: (usize, String, bool) =
                from_value(q.get_timeout(Duration::from_secs(30)).unwrap()).unwrap();
            assert_eq!(got, (10_000, "/data/train/00009999.jpeg".to_string(), true), "(count, last, sealed)");
        }
    }
}

#[test]
fn malformed_handoffs_are_errors() {
    let cases = [
        ("nocolon", "is not BYTES:FDS"),
        ("abc:", "odd number of hex digits"),
        ("zz:", "invalid digit"),
        ("00:x", "bad descriptor list"),
        ("00:-1", "bad descriptor list"),
        ("00:100000", "is not open"),
        ("00:0,0", "named twice"),
        ("@x:", "bad descriptor"),
        ("@0:0", "named twice"),
        ("@100000:", "is not open"),
    ];
    for (i, (text, says)) in cases.iter().enumerate() {
        let var = format!("{VAR}_BAD_{i}");
        std::env::set_var(&var, text);
        // SAFETY: every case is refused before any descriptor is adopted: the text names
        // none, names one that is not open, or names one twice. The other tests' threads
        // touch the environment only through std (`Command` reads it under std's lock, which
        // `from_env`'s removal takes too).
        let e = unsafe { Message::from_env(&var) }.unwrap_err();
        assert!(matches!(e, Error::InvalidMessage(_)) && e.to_string().contains(says), "{text:?}: {e}");
    }
    // SAFETY: the variable is not set, so nothing is adopted or removed.
    let e = unsafe { Message::from_env("TENSORSHARE_TEST_HANDOFF_UNSET") }.unwrap_err();
    assert!(e.to_string().contains("TENSORSHARE_TEST_HANDOFF_UNSET"), "{e}");
}
