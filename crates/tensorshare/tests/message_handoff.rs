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
    // SAFETY: the parent passed these descriptors for this message; nothing else here owns
    // them, and the variable is read once.
    let message = unsafe { Message::from_env(VAR) }.unwrap();
    let (q, mut t): (Queue<Value>, Tensor) = from_value(message.decode().unwrap()).unwrap();
    t.fill(7.0f32).unwrap();
    q.put(Value::Str("filled".into())).unwrap();
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
    message.pass_to(&mut cmd, VAR);
    let status = cmd.status().unwrap();
    assert!(status.success(), "{status}");
    drop(cmd); // the message's descriptors close with it
    assert!(matches!(q.get_timeout(Duration::from_secs(30)).unwrap(), Value::Str(s) if s == "filled"));
    assert_eq!(t.to_vec::<f32>().unwrap(), vec![7.0; 4]);
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
    ];
    for (i, (text, says)) in cases.iter().enumerate() {
        let var = format!("{VAR}_BAD_{i}");
        std::env::set_var(&var, text);
        // SAFETY: every case is refused before any descriptor is adopted: the text names
        // none, names one that is not open, or names one twice.
        let e = unsafe { Message::from_env(&var) }.unwrap_err();
        assert!(matches!(e, Error::InvalidMessage(_)) && e.to_string().contains(says), "{text:?}: {e}");
    }
    // SAFETY: the variable is not set, so nothing is adopted.
    let e = unsafe { Message::from_env("TENSORSHARE_TEST_HANDOFF_UNSET") }.unwrap_err();
    assert!(e.to_string().contains("TENSORSHARE_TEST_HANDOFF_UNSET"), "{e}");
}
