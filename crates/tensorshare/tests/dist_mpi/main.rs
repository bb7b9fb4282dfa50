//! `tensorshare::dist` between real ranks started by `mpirun` (feature `mpi`).
//!
//! This binary is its own harness. Run by `cargo test`, it is the launcher: each test runs
//! `mpirun` on this very binary, whose ranks run the scenario named after `--scenario`
//! (`ranks.rs`) and print one line each; the launcher checks those lines, the exit status,
//! and that the run left nothing in its private temporary directory (Open MPI's session
//! directory and shared-memory files go there). A scenario that does not report within
//! its time limit fails, its `mpirun` killed.
//!
//! `cargo test -p tensorshare --features mpi --test dist_mpi -- [FILTER]`

mod launch;
mod ranks;
mod suite;

fn main() {
    tensorshare::init(); // workers the ranks start run their job here
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let Some(k) = args.iter().position(|a| a == "--scenario") {
        let name = args.get(k + 1).map(String::as_str).unwrap_or("");
        std::process::exit(ranks::run(name));
    }
    if args.iter().any(|a| a == "--list") {
        for (name, _) in TESTS {
            println!("{name}: test");
        }
        return;
    }
    let filters: Vec<&String> = args.iter().filter(|a| !a.starts_with('-')).collect();
    let chosen: Vec<_> = TESTS
        .iter()
        .filter(|(n, _)| filters.is_empty() || filters.iter().any(|f| n.contains(f.as_str())))
        .collect();
    println!("\nrunning {} tests", chosen.len());
    let (mut passed, mut failed, mut skipped) = (0, 0, 0);
    for (name, test) in chosen {
        let started = std::time::Instant::now();
        match test() {
            Outcome::Passed => {
                passed += 1;
                println!("test {name} ... ok ({:.1} s)", started.elapsed().as_secs_f64());
            }
            Outcome::Skipped(why) => {
                skipped += 1;
                println!("test {name} ... SKIPPED: {why}");
            }
            Outcome::Failed(why) => {
                failed += 1;
                println!("test {name} ... FAILED\n{why}\n");
            }
        }
    }
    let verdict = if failed == 0 { "ok" } else { "FAILED" };
    println!("\ntest result: {verdict}. {passed} passed; {failed} failed; {skipped} skipped\n");
    if failed > 0 {
        std::process::exit(1);
    }
}

/// How a test ended. A skip says why, and is reported as such (never as a pass).
pub enum Outcome {
    Passed,
    Skipped(String),
    Failed(String),
}

type Test = fn() -> Outcome;

const TESTS: &[(&str, Test)] = &[
    ("four_ranks_on_one_node", launch::four_ranks_on_one_node),
    ("a_job_of_one_rank_without_mpirun", launch::a_job_of_one_rank_without_mpirun),
    ("a_rank_that_dies_is_named_by_the_others", launch::a_rank_that_dies_is_named_by_the_others),
    (
        "a_rank_that_dies_leaving_a_fork_is_named_by_the_others",
        launch::a_rank_that_dies_leaving_a_fork_is_named_by_the_others,
    ),
    (
        "a_rank_that_panics_with_values_on_their_way_is_named",
        launch::a_rank_that_panics_with_values_on_their_way_is_named,
    ),
    (
        "a_rank_that_ends_its_session_while_another_sends_is_named",
        launch::a_rank_that_ends_its_session_while_another_sends_is_named,
    ),
    ("two_nodes_in_network_namespaces", launch::two_nodes_in_network_namespaces),
];
