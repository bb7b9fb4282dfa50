//! Test support shared by the test files that start workers. Each test file uses a part.
#![allow(dead_code)]

use tensorshare::{spawn, start_processes, Job, Queue, StartMethod, Tensor, TensorKind};

/// Runs `body(method)` in a fresh single-threaded process (a Spawn worker), and fails the
/// calling test with the body's panic, location and backtrace if it fails.
///
/// The Fork start method forks the calling process. A test binary runs tests on many
/// threads at once, and a lock that another thread holds at the fork (the standard
/// library's stdout, environment or panic hook) would stay locked in the child for good, so
/// tests fork only from a process that has no other busy threads, as programs should.
pub fn isolated<J: Job<StartMethod>>(body: J, method: StartMethod) {
    let mut ctx = start_processes(body, method, 1, StartMethod::Spawn).expect("start the helper process");
    if let Err(e) = ctx.join(None) {
        panic!("{e:#}");
    }
}

/// Lets a helper process made by [`isolated`] fork although the test harness gave it a
/// second thread.
pub fn allow_fork_in_helper() {
    // SAFETY: a helper runs one test (`--test-threads=1`), on a thread of its own, while the
    // harness's main thread only waits for that test to end, blocked in a channel receive
    // that holds no lock; nothing else runs, so no lock is held by another thread when this
    // thread forks.
    unsafe { tensorshare::allow_fork_with_threads() }
}

/// How many times each sharing test body runs: `TENSORSHARE_TEST_REPEATS` (torch runs
/// them 30 times; CI once, to stay within its time).
pub fn repeats() -> usize {
    std::env::var("TENSORSHARE_TEST_REPEATS").ok().and_then(|v| v.parse().ok()).unwrap_or(1)
}

/// This process's open descriptors.
pub fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").map(|d| d.count()).unwrap_or(0)
}

/// This process's memory mappings (lines of /proc/self/maps).
pub fn mappings() -> usize {
    std::fs::read_to_string("/proc/self/maps").map(|m| m.lines().count()).unwrap_or(0)
}

/// torch's leak checker, made strict: built at the start of a test body (in a helper
/// process of its own, see [`checked`]), it founds a fresh cleanup group and counts this
/// process's descriptors; [`LeakChecker::check`] at the end asserts that no segment file
/// of the group is left and that the descriptor count is back where it was.
pub struct LeakChecker {
    root: i32,
    fds: usize,
}

impl LeakChecker {
    pub fn new() -> LeakChecker {
        let root = tensorshare::raw::new_group().expect("found a cleanup group");
        tensorshare::trim_arenas();
        // Kept for the process's life once it receives: not the test's.
        tensorshare::raw::keep_descriptors_in_reserve().expect("descriptors in reserve");
        LeakChecker { root, fds: open_fds() }
    }

    pub fn check(self) {
        // Arenas kept for reuse and mappings kept for speed are let go first: what stays
        // after that is a leak.
        tensorshare::trim_arenas();
        let left: Vec<_> = tensorshare::segments::list()
            .expect("list segments")
            .into_iter()
            .filter(|s| s.root == self.root && s.creator.is_some())
            .collect();
        assert!(left.is_empty(), "shared-memory files left behind: {left:?}");
        assert_eq!(open_fds(), self.fds, "descriptors leaked by the test");
    }
}

/// Runs `body(arg)` in a helper process of its own, between a [`LeakChecker`]'s start and
/// check, so that the counts belong to this test alone.
#[macro_export]
macro_rules! checked {
    ($body:path, $arg:expr, $argty:ty) => {
        $crate::common::isolated_with(
            |_rank, a: $argty| {
                let lc = $crate::common::LeakChecker::new();
                for _ in 0..$crate::common::repeats() {
                    $body(a);
                }
                lc.check();
            },
            $arg,
        )
    };
}

/// Runs a job in a helper process (Spawn) and fails with its error.
pub fn isolated_with<A, J>(body: J, arg: A)
where
    A: serde::Serialize + serde::de::DeserializeOwned,
    J: Job<A>,
{
    let mut ctx = start_processes(body, arg, 1, StartMethod::Spawn).expect("start the helper process");
    if let Err(e) = ctx.join(None) {
        panic!("{e:#}");
    }
}

/// Sends `v` to a worker, which sends it back; returns what came back.
pub fn round_trip(v: Vec<Tensor>) -> Vec<Tensor> {
    let q: Queue<Vec<Tensor>> = Queue::new().unwrap();
    let back: Queue<Vec<Tensor>> = Queue::new().unwrap();
    let mut ctx = spawn(
        |_rank, (q, back): (Queue<Vec<Tensor>>, Queue<Vec<Tensor>>)| back.put(q.get().unwrap()).unwrap(),
        (q.clone(), back.clone()),
        1,
    )
    .unwrap();
    q.put(v).unwrap();
    let r = back.get().unwrap();
    assert_eq!(ctx.join(None), Ok(true));
    r
}

/// torch's test_integer_parameter_serialization: an int64 parameter holding 0 (which cannot
/// require gradients) reaches a worker, which checks its kind, flag and value.
pub fn integer_parameter_reaches_a_worker(ip: Tensor) {
    let mut ctx = spawn(
        |_rank, ip: Tensor| {
            assert_eq!(ip.kind(), TensorKind::Parameter);
            assert!(!ip.requires_grad());
            assert_eq!(ip.to_vec::<i64>().unwrap(), vec![0]);
        },
        ip,
        1,
    )
    .unwrap();
    assert_eq!(ctx.join(None), Ok(true));
}

/// A directory of a test's own, removed with everything in it when dropped.
pub struct TempDir(std::path::PathBuf);

impl TempDir {
    /// `tensorshare-weights-PID-TAG` under the system's temporary directory, made empty.
    pub fn new(tag: &str) -> TempDir {
        let dir = std::env::temp_dir().join(format!("tensorshare-weights-{}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }

    /// The path of `name` in the directory.
    pub fn path(&self, name: &str) -> std::path::PathBuf {
        self.0.join(name)
    }

    /// The names of the files in the directory, sorted.
    pub fn files(&self) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(&self.0)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The creator hands out every other 4 KiB slot, twice as many as its arenas held, and
/// writes 7.0 into each: a slot still held anywhere is never among them.
pub fn hand_out_everything_else() -> Vec<Tensor> {
    (0..4096)
        .map(|_| {
            let mut x = Tensor::empty_shared(&[1024], tensorshare::DType::F32).unwrap();
            x.fill(7.0f32).unwrap();
            x
        })
        .collect()
}
