//! Shared storages: torch's is_shared tests, strategies, and a full shared-memory
//! filesystem.

use tensorshare::{
    get_all_sharing_strategies, get_sharing_strategy, DType, Error, SharingStrategy, Storage, Tensor,
};

/// torch: test_empty_shared.
#[test]
fn test_empty_shared() {
    for strategy in get_all_sharing_strategies() {
        let mut t = Tensor::zeros(&[0], DType::F32);
        t.share_memory_with(strategy).unwrap();
        assert!(t.is_shared());
        assert_eq!(t.numel(), 0);
        assert!(t.to_vec::<f32>().unwrap().is_empty());
    }
}

/// torch: test_is_shared.
#[test]
fn test_is_shared() {
    let mut t = Tensor::full(&[5, 5], 0.5f32);
    assert!(!t.is_shared());
    t.share_memory_with(SharingStrategy::FileDescriptor).unwrap();
    assert!(t.is_shared());
    assert_eq!(t.storage().sharing_strategy(), Some(SharingStrategy::FileDescriptor));
    assert_eq!(t.to_vec::<f32>().unwrap(), vec![0.5; 25]);
}

/// torch: test_fs_is_shared — the same under file_system, with a named segment that exists
/// while the tensor lives.
#[test]
fn test_fs_is_shared() {
    let mut t = Tensor::full(&[5, 5], 1.5f64);
    assert!(!t.is_shared());
    t.share_memory_with(SharingStrategy::FileSystem).unwrap();
    assert!(t.is_shared());
    assert_eq!(t.storage().sharing_strategy(), Some(SharingStrategy::FileSystem));
    let name = t.storage().segment_name().expect("a file_system storage has a named segment");
    assert!(name.starts_with(&format!("tensorshare_{}_", std::process::id())), "{name}");
    let path = tensorshare::segments::shm_dir().join(&name);
    let meta = std::fs::metadata(&path).unwrap();
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(meta.permissions().mode() & 0o777, 0o600, "segments are private to their user");
    assert_eq!(t.to_vec::<f64>().unwrap(), vec![1.5; 25]);
}

#[test]
fn default_strategy_is_file_descriptor_and_names_round_trip() {
    if std::env::var_os(tensorshare::STRATEGY_ENV).is_none() {
        assert_eq!(get_sharing_strategy(), SharingStrategy::FileDescriptor);
    }
    for s in get_all_sharing_strategies() {
        assert_eq!(s.to_string().parse::<SharingStrategy>().unwrap(), s);
    }
    assert!(matches!("file_sytem".parse::<SharingStrategy>(), Err(Error::Parse(_))));
}

#[test]
fn empty_shared_tensors_are_shared_and_writable() {
    for strategy in get_all_sharing_strategies() {
        let mut t = Tensor::empty_shared_with(&[3, 4], DType::I16, strategy).unwrap();
        assert!(t.is_shared());
        t.fill(7i16).unwrap();
        assert_eq!(t.to_vec::<i16>().unwrap(), vec![7; 12]);
        assert_eq!(t.storage().as_ptr() as usize % 64, 0);
    }
}

#[test]
fn an_impossible_memfd_request_is_out_of_shared_memory_not_a_crash() {
    let err = Storage::empty_shared_with(1 << 50, SharingStrategy::FileDescriptor).unwrap_err();
    match err {
        Error::OutOfSharedMemory { requested, available, .. } => {
            assert!(requested >= 1 << 50);
            assert!(available < requested);
        }
        e => panic!("expected OutOfSharedMemory, got {e}"),
    }
}

/// A full /dev/shm (Docker's 64 MB, here a 1 MiB tmpfs mounted over /dev/shm in a private
/// mount namespace of one thread): the allocation fails with OutOfSharedMemory, what is
/// already shared stays readable, and nothing is left in the filesystem.
#[test]
fn a_full_shm_filesystem_gives_out_of_shared_memory() {
    // The process's cleanup group lives in the real /dev/shm: found it before one thread
    // moves to its own mount namespace.
    tensorshare::raw::ensure_group().unwrap();
    let outcome = std::thread::spawn(|| -> Result<(), String> {
        use rustix::mount::{mount, mount_change, MountFlags, MountPropagationFlags};
        use rustix::thread::{unshare_unsafe, UnshareFlags};
        // SAFETY: unsharing the mount namespace (and the fs info it implies) affects only this
        // thread, which touches no other thread's working directory or root.
        if let Err(e) = unsafe { unshare_unsafe(UnshareFlags::NEWNS) } {
            return Err(format!("unshare(CLONE_NEWNS): {e} (needs root or CAP_SYS_ADMIN)"));
        }
        mount_change("/", MountPropagationFlags::PRIVATE | MountPropagationFlags::REC)
            .map_err(|e| format!("making / private: {e}"))?;
        mount("tmpfs", "/dev/shm", "tmpfs", MountFlags::empty(), Some(c"size=1m"))
            .map_err(|e| format!("mounting a tmpfs: {e}"))?;
        let dir = tensorshare::segments::shm_dir();
        let small =
            Tensor::empty_shared_with(&[1000], DType::U8, SharingStrategy::FileSystem).and_then(|mut t| {
                t.fill(3u8)?;
                Ok(t)
            });
        // The first arena may or may not fit 1 MiB; either way no SIGBUS, and a clear error.
        let big = Tensor::empty_shared_with(&[2 << 20], DType::U8, SharingStrategy::FileSystem);
        match big {
            Err(Error::OutOfSharedMemory { requested, available, place }) => {
                assert!(requested >= 2 << 20);
                assert!(available <= 1 << 20, "available {available}");
                assert!(place.contains(&dir.display().to_string()), "{place}");
            }
            other => panic!("expected OutOfSharedMemory, got {other:?}"),
        }
        if let Ok(t) = &small {
            assert_eq!(t.to_vec::<u8>().unwrap(), vec![3; 1000], "what was shared before stays readable");
        }
        // The failed segment's file was removed.
        let leftovers: Vec<_> = std::fs::read_dir("/dev/shm")
            .unwrap()
            .filter_map(|e| e.ok())
            .filter(|e| {
                small.as_ref().ok().and_then(|t| t.storage().segment_name()).as_deref()
                    != e.file_name().to_str()
            })
            .collect();
        assert!(leftovers.is_empty(), "left in the tiny tmpfs: {leftovers:?}");
        Ok(())
    })
    .join()
    .expect("the test thread panicked");
    if let Err(why) = outcome {
        eprintln!("skipped: {why}");
    }
}
