//! A program whose `main` forgets `tensorshare::init()`: its workers run `main` again and
//! reach `spawn` themselves. The first of them must stop there, and its parent must say why.
//!
//! This file plays that program: it does not invoke `enable_test_workers!`, and its
//! `__tensorshare_worker` test (what a re-executed worker of a test binary runs, as `main`
//! for a program) starts workers without calling `init`.

use tensorshare::{spawn, Failure};

/// The worker's "main". In the test run itself (no worker variable) it does nothing.
#[test]
fn __tensorshare_worker() {
    if std::env::var_os("TENSORSHARE_WORKER").is_none() {
        return;
    }
    // A guard for code that lets this run away: a chain of workers stops three levels
    // down (its failure then fails the test below, as it should).
    let depth: u32 = std::env::var("FORGOTTEN_INIT_DEPTH").ok().and_then(|d| d.parse().ok()).unwrap_or(0);
    if depth >= 3 {
        std::process::exit(7);
    }
    std::env::set_var("FORGOTTEN_INIT_DEPTH", (depth + 1).to_string());
    // Two workers: without the guard, a fork bomb.
    let started = spawn(|_rank, _: ()| {}, (), 2);
    let mut ctx = started.expect("spawn returned an error instead of stopping the worker");
    if let Err(e) = ctx.join(None) {
        panic!("{e}");
    }
}

#[test]
fn a_worker_that_reaches_spawn_without_init_fails_at_the_first_level() {
    let mut ctx = spawn(|_rank, _: ()| {}, (), 1).unwrap();
    let err = ctx.join(None).unwrap_err();
    match &err.failure {
        Failure::Lost { reason } => assert!(
            reason.contains("the worker reached spawn") && reason.contains("tensorshare::init() first"),
            "{err}"
        ),
        _ => panic!("{err}"),
    }
}
