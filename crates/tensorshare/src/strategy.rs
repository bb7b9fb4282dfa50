//! Sharing strategies: how shared memory is named and handed to other processes.

use std::fmt;
use std::str::FromStr;
use std::sync::atomic::{AtomicU8, Ordering};

use serde::{Deserialize, Serialize};

use crate::{Error, Result};

/// The environment variable that sets the default strategy at start (torch's names).
pub const STRATEGY_ENV: &str = "TENSORSHARE_SHARING_STRATEGY";

/// How shared memory is created and passed between processes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum SharingStrategy {
    /// Anonymous memory files (memfd). The file descriptor travels inside each message
    /// (SCM_RIGHTS); nothing has a name, so nothing can leak, and /dev/shm's size does not
    /// bound it. The default on Linux.
    FileDescriptor,
    /// Named files in the shared-memory directory (`/dev/shm`, or `$TENSORSHARE_SHM_DIR`).
    /// Messages carry the name instead of a descriptor.
    FileSystem,
}

impl SharingStrategy {
    /// torch's name: `file_descriptor` or `file_system`.
    pub const fn name(self) -> &'static str {
        match self {
            SharingStrategy::FileDescriptor => "file_descriptor",
            SharingStrategy::FileSystem => "file_system",
        }
    }

    fn code(self) -> u8 {
        match self {
            SharingStrategy::FileDescriptor => 1,
            SharingStrategy::FileSystem => 2,
        }
    }
}

impl fmt::Display for SharingStrategy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for SharingStrategy {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "file_descriptor" => Ok(SharingStrategy::FileDescriptor),
            "file_system" => Ok(SharingStrategy::FileSystem),
            _ => Err(Error::Parse(format!(
                "unknown sharing strategy {s:?}; expected one of: file_descriptor, file_system"
            ))),
        }
    }
}

/// 0 means "not read from the environment yet".
static CURRENT: AtomicU8 = AtomicU8::new(0);

fn default_strategy() -> SharingStrategy {
    match std::env::var(STRATEGY_ENV) {
        Ok(v) => match v.parse::<SharingStrategy>() {
            Ok(s) => s,
            Err(e) => {
                eprintln!("tensorshare: ignoring {STRATEGY_ENV}: {e}");
                SharingStrategy::FileDescriptor
            }
        },
        Err(_) => SharingStrategy::FileDescriptor,
    }
}

/// The strategies this platform supports (torch's `get_all_sharing_strategies`).
pub fn get_all_sharing_strategies() -> Vec<SharingStrategy> {
    vec![SharingStrategy::FileDescriptor, SharingStrategy::FileSystem]
}

/// The strategy used for memory shared from now on in this process.
pub fn get_sharing_strategy() -> SharingStrategy {
    match CURRENT.load(Ordering::Relaxed) {
        1 => SharingStrategy::FileDescriptor,
        2 => SharingStrategy::FileSystem,
        _ => {
            let s = default_strategy();
            // Another thread may have set a strategy meanwhile: keep theirs.
            let _ = CURRENT.compare_exchange(0, s.code(), Ordering::Relaxed, Ordering::Relaxed);
            get_sharing_strategy()
        }
    }
}

/// Sets the strategy for memory shared from now on in this process. Memory already shared
/// keeps its strategy. Workers started later inherit it.
pub fn set_sharing_strategy(strategy: SharingStrategy) -> Result<()> {
    if !get_all_sharing_strategies().contains(&strategy) {
        return Err(Error::Unsupported(format!("the {strategy} strategy on this platform")));
    }
    CURRENT.store(strategy.code(), Ordering::Relaxed);
    Ok(())
}
