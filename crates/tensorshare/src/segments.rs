//! Named shared-memory segments as files (the file_system strategy): where they live, how
//! much room is left, and the tools behind `tensorshare shm ls` and `tensorshare shm gc`.
//!
//! A named segment is called `tensorshare_<root>_<creator>_<random>` in [`shm_dir`], where
//! `<root>` is the pid of the process that founded its cleanup group: once every process of
//! the group is gone, its files are removed by the group's cleaner; [`gc`] removes the files
//! of groups that have no live process left, should a cleaner not have done it.

pub use crate::shm::{available_bytes, gc, list, shm_dir, SegmentInfo, SHM_DIR_ENV};
