//! What the fuzz targets share: a realistic message with real descriptors, made once by a
//! sender process that then exits; ways to damage its descriptor table; and the checks
//! every decoded value must pass.
//!
//! The sample is made in a forked child so that, as for any receiver, the arenas it names
//! are not this process's own: decoding opens them, checks them and takes holds on their
//! slots, rather than finding them in the creator's allocator.

use std::io::IoSlice;
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

use tensorshare::{raw, DType, Device, NestedTensor, Queue, SharedFd, SparseTensor, Tensor};

/// The value every message is decoded as.
pub type Sample = (Vec<Tensor>, Vec<SparseTensor>, NestedTensor, Queue<u32>, SharedFd);

/// The sample's message as its sender made it, and descriptors that are not what a message
/// expects.
pub struct Fixture {
    /// The message's bytes.
    pub message: Vec<u8>,
    /// Its descriptor table, in order. Each execution gets duplicates; these stay open, so
    /// the holds the message carries on its slots last as long as the fuzzing does.
    pub fds: Vec<OwnedFd>,
    /// Descriptors of the wrong kind: copies of an arena (unsealed and sealed), /dev/null,
    /// a socket, a pipe, a sealed page of zeros.
    pub strangers: Vec<OwnedFd>,
}

const ARENA_MAGIC: &[u8; 8] = b"TSARENA2";

/// Tensors of several size classes (a 128-byte slot, a 32 KiB slot, a one-slot arena of
/// 5 MiB of which only a view at the very end travels), views of them (transposed,
/// narrowed, selected, permuted), a bool, a scalar, a parameter, an empty and a meta tensor;
/// sparse tensors in COO and CSR; a nested tensor; a bounded queue; a pipe's read end.
fn build_sample() -> tensorshare::Result<Sample> {
    let small = Tensor::from_vec((0..24).map(|v| v as f32).collect(), &[4, 6])?;
    let mid = Tensor::from_vec((0..64 * 64).map(|v| v as f64).collect(), &[64, 64])?;
    const BIG: usize = 5 << 20;
    let big = Tensor::zeros(&[BIG], DType::U8);
    big.narrow(0, BIG - 4096, 4096)?.fill(7u8)?;
    let tail = big.narrow(0, BIG - 1024, 1024)?.reshape(&[32, 32])?.t()?;
    let mut param = Tensor::full(&[3], 0.5f32).into_parameter();
    param.set_requires_grad(true)?;
    let tensors = vec![
        small.clone(),
        small.t()?,
        small.narrow(1, 2, 3)?,
        small.select(0, 3)?,
        mid.narrow(0, 8, 16)?.permute(&[1, 0])?,
        mid,
        tail,
        Tensor::from_vec(vec![true, false, true], &[3])?,
        Tensor::from_vec(vec![42i64], &[])?,
        param,
        Tensor::zeros(&[0, 3], DType::F32),
        Tensor::meta(&[2, 3], DType::F16),
        Tensor::zeros(&[8], DType::BF16),
    ];
    let coo = SparseTensor::coo(
        Tensor::from_vec(vec![0i64, 1, 1, 0], &[2, 2])?,
        Tensor::from_vec(vec![1i32, 2], &[2])?,
        &[2, 2],
    )?;
    let csr = SparseTensor::csr(
        Tensor::from_vec(vec![0i64, 1, 2], &[3])?,
        Tensor::from_vec(vec![1i64, 0], &[2])?,
        Tensor::from_vec(vec![1.0f32, 2.0], &[2])?,
        &[2, 2],
    )?;
    let nested =
        NestedTensor::from_tensors(&[Tensor::ones(&[2, 2], DType::I16), Tensor::ones(&[1, 2], DType::I16)])?;
    let queue = Queue::<u32>::with_capacity(4)?;
    let (read, _write) = rustix::pipe::pipe()
        .map_err(|e| tensorshare::Error::Io { context: "pipe".into(), source: e.into() })?;
    Ok((tensors, vec![coo, csr], nested, queue, SharedFd::new(read)))
}

/// Writes one SEQPACKET record with `fds` attached, as a peer may.
pub fn send_raw(sock: BorrowedFd<'_>, bytes: &[u8], fds: &[BorrowedFd<'_>]) -> rustix::io::Result<()> {
    use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage, SendFlags};
    let iov = [IoSlice::new(bytes)];
    let mut space = vec![MaybeUninit::<u8>::uninit(); SendAncillaryMessage::ScmRights(fds).size()];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !fds.is_empty() && !control.push(SendAncillaryMessage::ScmRights(fds)) {
        return Err(rustix::io::Errno::NOBUFS);
    }
    rustix::net::sendmsg(sock, &iov, &mut control, SendFlags::DONTWAIT | SendFlags::NOSIGNAL).map(|_| ())
}

fn recv_raw(sock: BorrowedFd<'_>) -> (Vec<u8>, Vec<OwnedFd>) {
    use rustix::net::{RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags};
    let mut buf = vec![0u8; 1 << 20];
    let mut space = vec![MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(253))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let mut iov = [std::io::IoSliceMut::new(&mut buf)];
    let r = rustix::net::recvmsg(sock, &mut iov, &mut control, RecvFlags::CMSG_CLOEXEC).expect("recvmsg");
    let mut fds = Vec::new();
    for m in control.drain() {
        if let RecvAncillaryMessage::ScmRights(rights) = m {
            fds.extend(rights);
        }
    }
    buf.truncate(r.bytes);
    (buf, fds)
}

fn seqpacket_pair() -> (OwnedFd, OwnedFd) {
    rustix::net::socketpair(
        rustix::net::AddressFamily::UNIX,
        rustix::net::SocketType::SEQPACKET,
        rustix::net::SocketFlags::CLOEXEC,
        None,
    )
    .expect("socketpair")
}

/// A memfd holding `bytes`, with `seals` added (none: unsealed).
pub fn memfd_with(bytes: &[u8], seals: rustix::fs::SealFlags) -> OwnedFd {
    use rustix::fs::MemfdFlags;
    let fd =
        rustix::fs::memfd_create("fuzz", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING).expect("memfd");
    let mut off = 0;
    while off < bytes.len() {
        off += rustix::io::pwrite(&fd, &bytes[off..], off as u64).expect("pwrite");
    }
    if !seals.is_empty() {
        rustix::fs::fcntl_add_seals(&fd, seals).expect("seals");
    }
    fd
}

/// The seals a sender puts on a memfd it passes on.
pub const SEALED: rustix::fs::SealFlags = rustix::fs::SealFlags::WRITE
    .union(rustix::fs::SealFlags::SHRINK)
    .union(rustix::fs::SealFlags::GROW)
    .union(rustix::fs::SealFlags::SEAL);

fn read_all(fd: &OwnedFd) -> Vec<u8> {
    let len = rustix::fs::fstat(fd).expect("fstat").st_size as usize;
    let mut data = vec![0u8; len];
    let mut off = 0;
    while off < len {
        let n = rustix::io::pread(fd, &mut data[off..], off as u64).expect("pread");
        assert!(n > 0, "short arena file");
        off += n;
    }
    data
}

/// The fixture, made on first use: a child process builds and encodes the sample, passes
/// the message and its descriptors over a socket, and exits.
pub fn fixture() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(|| {
        let (parent, child) = seqpacket_pair();
        // SAFETY: the child only builds the sample with the library, sends it and calls
        // _exit; it returns to nothing of the parent's.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork failed");
        if pid == 0 {
            drop(parent);
            let code = match build_sample().and_then(|s| raw::encode(&s)) {
                Ok((bytes, fds)) => {
                    let b: Vec<_> = fds.iter().map(AsFd::as_fd).collect();
                    i32::from(send_raw(child.as_fd(), &bytes, &b).is_err())
                }
                Err(e) => {
                    eprintln!("building the fuzz sample: {e}");
                    2
                }
            };
            // SAFETY: ends the child without running the parent's exit handlers.
            unsafe { libc::_exit(code) };
        }
        drop(child);
        let mut status = 0;
        // SAFETY: waiting for the child forked above.
        unsafe { libc::waitpid(pid, &mut status, 0) };
        assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0, "the sample's sender failed");
        let (message, fds) = recv_raw(parent.as_fd());
        assert!(fds.len() >= 4, "the sample names several arenas, a queue and a pipe");
        let arena = fds
            .iter()
            .map(read_all_if_arena)
            .find_map(|a| a)
            .expect("one of the sample's descriptors is an arena");
        let (sock, _) = seqpacket_pair();
        let (pipe_r, _) = rustix::pipe::pipe().expect("pipe");
        let strangers = vec![
            memfd_with(&arena, rustix::fs::SealFlags::empty()),
            memfd_with(&arena, SEALED),
            std::fs::File::open("/dev/null").expect("/dev/null").into(),
            sock,
            pipe_r,
            memfd_with(&[0u8; 4096], SEALED),
        ];
        eprintln!(
            "fuzz fixture: a message of {} bytes with {} descriptors, {} strangers",
            message.len(),
            fds.len(),
            strangers.len()
        );
        Fixture { message, fds, strangers }
    })
}

fn read_all_if_arena(fd: &OwnedFd) -> Option<Vec<u8>> {
    let mut magic = [0u8; 8];
    match rustix::io::pread(fd, &mut magic, 0) {
        Ok(8) if &magic == ARENA_MAGIC => Some(read_all(fd)),
        _ => None,
    }
}

/// A descriptor table for one execution, chosen by `sel`: the low three bits say what is
/// done to the sample's table (kept, reversed, rotated, one dropped, one duplicated over
/// another, two swapped, one replaced by a stranger, emptied), the high five bits where.
/// Every descriptor is a duplicate: the fixture's stay open.
pub fn pick_fds(sel: u8) -> Vec<OwnedFd> {
    let f = fixture();
    let n = f.fds.len();
    let p = usize::from(sel >> 3);
    let dup = |fd: &OwnedFd| fd.try_clone().expect("dup");
    let mut v: Vec<OwnedFd> = f.fds.iter().map(dup).collect();
    match sel & 7 {
        0 => {}
        1 => v.reverse(),
        2 => v.rotate_left(p % n),
        3 => {
            v.remove(p % n);
        }
        4 => v[(p + 1) % n] = dup(&f.fds[p % n]),
        5 => v.swap(p % n, (p + 1) % n),
        6 => v[p % n] = dup(&f.strangers[(p / n) % f.strangers.len()]),
        _ => v.clear(),
    }
    v
}

/// Bytes of one element walk above which a view is checked by arithmetic and by its
/// storage's ends only (a view may repeat elements with zero strides: a few bytes of
/// storage can be terabytes of view).
const MAX_WALK: u128 = 1 << 22;

/// Checks a decoded tensor and reads it: its view lies inside its storage, the storage's
/// first and last bytes can be read, and (when not huge) every element of the view, with
/// safe copies, so that a view or storage outside its memory would fault here.
pub fn check_tensor(t: &Tensor) {
    assert_eq!(t.shape().len(), t.strides().len(), "one stride per dimension");
    if t.device() != Device::Cpu {
        assert_eq!(t.device(), Device::Meta, "this build has no devices");
        return;
    }
    let size = t.dtype().size() as u128;
    let storage_len = t.storage().len();
    let numel = t.shape().iter().try_fold(1u128, |a, &d| a.checked_mul(d as u128));
    let numel = numel.expect("a decoded shape whose element count overflows u128");
    if numel > 0 {
        let mut last = t.storage_offset() as u128;
        for (&d, &s) in t.shape().iter().zip(t.strides()) {
            let span = (d as u128 - 1).checked_mul(s as u128).expect("span overflows u128");
            last = last.checked_add(span).expect("extent overflows u128");
        }
        let end = (last + 1).checked_mul(size).expect("extent overflows u128");
        assert!(
            end <= storage_len as u128,
            "a decoded {:?} view (shape {:?}, strides {:?}, offset {}) reaches byte {end} of a storage of {storage_len}",
            t.dtype(),
            t.shape(),
            t.strides(),
            t.storage_offset()
        );
        if numel * size <= MAX_WALK {
            let bytes = t.to_bytes().expect("a decoded cpu tensor reads");
            assert_eq!(bytes.len() as u128, numel * size);
            if t.dtype() == DType::Bool {
                let _ = t.to_vec::<bool>(); // bytes other than 0 and 1 are an error, not UB
            }
        }
    }
    if storage_len > 0 {
        for at in [0, storage_len - 1] {
            let b = Tensor::from_storage(t.storage().clone(), DType::U8, &[1], &[1], at)
                .expect("one byte of a storage is a view of it");
            assert_eq!(b.to_bytes().expect("a byte of a decoded storage reads").len(), 1);
        }
    }
}

/// Checks and reads everything a decoded sample holds.
pub fn touch(s: &Sample) {
    let (tensors, sparse, nested, queue, fd) = s;
    tensors.iter().for_each(check_tensor);
    for sp in sparse {
        check_tensor(sp.values());
        sp.index_tensors().iter().for_each(check_tensor);
        let dense = sp.size().iter().try_fold(1usize, |a, &d| a.checked_mul(d));
        if dense.is_some_and(|n| n <= 1 << 16) {
            if let Ok(d) = sp.to_dense() {
                check_tensor(&d);
            }
        }
    }
    check_tensor(nested.buffer());
    nested.unbind().iter().for_each(check_tensor);
    let _ = queue.try_get(); // never blocks; nothing was put
    let _ = rustix::fs::fstat(fd).expect("a received descriptor is open");
}

static EXECUTIONS: AtomicU64 = AtomicU64::new(0);
const CHECK_EVERY: u64 = 1 << 14;

fn entries(dir: &str) -> usize {
    std::fs::read_dir(dir).map(|d| d.count()).unwrap_or(0)
}

fn lines(file: &str) -> usize {
    std::fs::read_to_string(file).map(|s| s.lines().count()).unwrap_or(0)
}

/// Counts executions; every 16384 of them, checks that this process's descriptors and
/// mappings have not grown since the first count (a leak of one per execution, or of one
/// per few thousand, shows as thousands). `FUZZ_REPORT=1` prints each count.
pub fn after_execution() {
    static BASE: OnceLock<(usize, usize)> = OnceLock::new();
    let n = EXECUTIONS.fetch_add(1, Ordering::Relaxed) + 1;
    if !n.is_multiple_of(CHECK_EVERY) {
        return;
    }
    let now = (entries("/proc/self/fd"), lines("/proc/self/maps"));
    let base = *BASE.get_or_init(|| now);
    if std::env::var_os("FUZZ_REPORT").is_some() {
        eprintln!("after {n} executions: {} descriptors, {} mappings (first count {base:?})", now.0, now.1);
    }
    assert!(now.0 <= base.0 + 256, "descriptors leak: {} after {n} executions, {} at first", now.0, base.0);
    assert!(now.1 <= base.1 + 4096, "mappings leak: {} after {n} executions, {} at first", now.1, base.1);
}

/// Writes `seeds` into the corpus directory libFuzzer was given (its first directory
/// argument), so that fuzzing starts from valid structure made with this very fixture.
pub fn write_seeds(target: &str, seeds: &[Vec<u8>]) {
    let dir = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .map(std::path::PathBuf::from)
        .find(|p| p.is_dir());
    let Some(dir) = dir else { return };
    for (i, s) in seeds.iter().enumerate() {
        let path = dir.join(format!("seed-{target}-{i}"));
        if std::fs::write(&path, s).is_err() {
            eprintln!("could not write the seed {}", path.display());
        }
    }
}
