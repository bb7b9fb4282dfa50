//! Jobs that break their worker's way of reporting: the parent says what happened, not
//! that `init` might be missing.

use std::os::unix::process::CommandExt;

use tensorshare::{spawn, Failure, ProcessError};

tensorshare::enable_test_workers!();

fn unreported(err: &ProcessError) -> &str {
    match &err.failure {
        Failure::Unreported { reason } => reason,
        _ => panic!("{err}"),
    }
}

fn exit_zero(_rank: usize, _: ()) {
    std::process::exit(0)
}

fn exec_true(_rank: usize, _: ()) {
    let e = std::process::Command::new("/bin/true").exec();
    panic!("exec failed: {e}");
}

#[test]
fn a_job_that_exits_with_zero_is_reported_as_such() {
    let mut ctx = spawn(exit_zero, (), 1).unwrap();
    let err = ctx.join(None).unwrap_err();
    assert!(unreported(&err).contains("exited with code 0 before reporting its result"), "{err}");
    assert!(err.to_string().starts_with("process 0 exited with code 0"), "{err}");
}

#[test]
fn a_job_that_closes_its_job_socket_is_reported_as_such() {
    let mut ctx = spawn(
        |_rank, _: ()| {
            // SAFETY: descriptor 3 is the job socket, which this job deliberately breaks;
            // nothing else in this worker uses it before the report.
            unsafe { libc::close(3) };
        },
        (),
        1,
    )
    .unwrap();
    let err = ctx.join(None).unwrap_err();
    assert!(unreported(&err).contains("closed its job socket (descriptor 3)"), "{err}");
}

#[test]
fn a_job_that_execs_is_reported_as_exiting_before_its_result() {
    let mut ctx = spawn(exec_true, (), 1).unwrap();
    let err = ctx.join(None).unwrap_err();
    assert!(unreported(&err).contains("exited with code 0 before reporting its result"), "{err}");
}
