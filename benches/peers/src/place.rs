//! Where the two processes of a run may run: anywhere, on two given cores, or both on one.

use rustix::thread::{sched_getaffinity, sched_setaffinity, CpuSet};

use crate::work::{Ctx, Res};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Placement {
    /// Both processes on whatever CPUs this program was allowed at its start.
    Unpinned,
    /// Parent on CPU 0, child on CPU 1: a hand-off between cores.
    Split,
    /// Both on CPU 0: every hand-off is a context switch.
    OneCore,
}

impl Placement {
    pub const ALL: [Placement; 3] = [Placement::Unpinned, Placement::Split, Placement::OneCore];

    pub fn name(self) -> &'static str {
        match self {
            Placement::Unpinned => "unpinned",
            Placement::Split => "split",
            Placement::OneCore => "one-core",
        }
    }

    /// The CPU of the parent, or `None` for the starting set.
    pub fn parent_cpu(self) -> Option<usize> {
        match self {
            Placement::Unpinned => None,
            Placement::Split | Placement::OneCore => Some(0),
        }
    }

    /// The CPU of the child, or `None` for the set it inherits from the parent.
    pub fn child_cpu(self) -> Option<usize> {
        match self {
            Placement::Unpinned => None,
            Placement::Split => Some(1),
            Placement::OneCore => Some(0),
        }
    }
}

/// The CPUs this process may use now.
pub fn current() -> Res<CpuSet> {
    sched_getaffinity(None).ctx("sched_getaffinity")
}

/// Pins the calling thread to `cpu`, or gives it `all` back for `None`. Threads it starts
/// afterwards (tensorshare's feeder) inherit the set.
pub fn pin(cpu: Option<usize>, all: &CpuSet) -> Res<()> {
    let set = match cpu {
        None => *all,
        Some(c) => {
            let mut s = CpuSet::new();
            s.set(c);
            s
        }
    };
    sched_setaffinity(None, &set).ctx("sched_setaffinity")
}

/// Pins the calling thread to `cpu` if one is named; a child given `None` keeps what it
/// inherited, which is the parent's starting set.
pub fn pin_child(cpu: Option<usize>) -> Res<()> {
    match cpu {
        None => Ok(()),
        Some(_) => pin(cpu, &CpuSet::new()),
    }
}

/// A CPU as a command-line word: its number, or `-` for none.
pub fn cpu_arg(cpu: Option<usize>) -> String {
    cpu.map_or_else(|| "-".into(), |c| c.to_string())
}

pub fn parse_cpu(s: &str) -> Res<Option<usize>> {
    match s {
        "-" => Ok(None),
        n => n.parse().map(Some).map_err(|_| format!("bad cpu {n:?}")),
    }
}
