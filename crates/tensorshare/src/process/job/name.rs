//! Naming a job: how a parent tells a worker which code to run, and how the worker checks
//! the name before it calls anything.
//!
//! Each job type `J` with arguments `A` has an entry function, `entry::<J, A>`, which the
//! compiler instantiates wherever `spawn` is called with them, and a *descriptor*: a
//! constant that holds a 128-bit magic number, the kind of entry (a worker's job, a pool
//! task, a pool initializer), a function returning the type name of `(J, A)`, and the entry
//! function. The parent names a job by the loaded object that holds its descriptor (the
//! executable, or a shared library by path), that object's GNU build-id, the descriptor's
//! offset from the object's load address, and a hash of the type name ([`JobName`]).
//!
//! The worker runs a job only after it has checked, in order:
//! 1. that it runs the same executable as its parent: its hello carries the parent's
//!    executable identity (file and build-id, see `handshake`), or it was forked;
//! 2. that the named object is loaded here and has the same build-id (a shared library
//!    without one is refused when it is named, unless the program called the `unsafe`
//!    [`trust_libraries_without_build_id`]);
//! 3. that a readable segment of that object holds the whole descriptor at the offset;
//! 4. that the bytes there carry the magic number and the expected kind, and that the
//!    descriptor's type name hashes to the one in the name.
//!
//! Only then does it call the entry function the descriptor holds (which the loader
//! relocated for this process). Naming by object and offset is what makes this hold across
//! a shared-library boundary (`-C prefer-dynamic`, a job in a `dylib`): each object is
//! mapped at its own randomised address, so an offset from one object's code (the old
//! anchor function in tensorshare) says nothing about where another object's code is.

use std::sync::atomic::{AtomicBool, Ordering};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use super::{Job, JobResult};
use crate::channel::socket::Record;
use crate::process::image::{self, Missing, ObjectName};
use crate::{wire, Error, Result};

/// The worker side of a job: decodes `(rank, state, args)` from the job record and runs.
pub(crate) type Entry = fn(Record) -> JobResult;
/// The worker side of a pool task: decodes a chunk of `count` items, runs each, and hands
/// each item's encoded outcome to `emit` as soon as it is done.
pub(crate) type TaskEntry = fn(Record, usize, &mut dyn FnMut(wire::Encoded) -> JobResult) -> JobResult;
/// A pool's initializer, run with the worker's rank and the record of its arguments.
pub(crate) type InitEntry = fn(usize, Record) -> JobResult;

pub(crate) fn entry<J: Job<A>, A: DeserializeOwned>(record: Record) -> JobResult {
    let (rank, state, args): (usize, J::State, A) =
        record.decode().map_err(|e| format!("cannot decode the job's arguments: {e}"))?;
    J::run(state, rank, args)
}

/// The function types a descriptor may hold, each with its kind.
pub(crate) trait EntryFn: Copy + 'static {
    const KIND: u64;
    const WHAT: &'static str;
}

impl EntryFn for Entry {
    const KIND: u64 = 0x6a6f_625f_656e_7472; // "job_entr"
    const WHAT: &'static str = "a worker's job";
}

impl EntryFn for TaskEntry {
    const KIND: u64 = 0x706f_6f6c_5f74_6173; // "pool_tas"
    const WHAT: &'static str = "a pool task";
}

impl EntryFn for InitEntry {
    const KIND: u64 = 0x706f_6f6c_5f69_6e69; // "pool_ini"
    const WHAT: &'static str = "a pool initializer";
}

/// Marks every descriptor; 128 random bits.
const MAGIC: [u64; 2] = [0x8c1f_3e5a_d27b_4f90, 0x51e6_a9c4_07d3_b82e];

/// What a worker may be asked to run: made at compile time for each job type (see the
/// module docs). `repr(C)`, and laid out as [`RawDesc`], so that a worker can check the
/// bytes before it trusts them as a descriptor.
#[repr(C)]
pub(crate) struct Desc<F> {
    magic: [u64; 2],
    kind: u64,
    type_name: fn() -> &'static str,
    f: F,
}

impl<F: EntryFn> Desc<F> {
    pub(crate) const fn new(type_name: fn() -> &'static str, f: F) -> Desc<F> {
        Desc { magic: MAGIC, kind: F::KIND, type_name, f }
    }
}

/// A descriptor's bytes, as integers: any bytes read from memory are a valid `RawDesc`.
#[repr(C)]
#[derive(Clone, Copy)]
struct RawDesc {
    magic: [u64; 2],
    kind: u64,
    type_name: usize,
    f: usize,
}

const _: () = {
    use std::mem::{align_of, size_of};
    assert!(size_of::<fn() -> &'static str>() == size_of::<usize>());
    assert!(size_of::<Entry>() == size_of::<usize>() && size_of::<TaskEntry>() == size_of::<usize>());
    assert!(size_of::<InitEntry>() == size_of::<usize>());
    assert!(
        size_of::<Desc<Entry>>() == size_of::<RawDesc>()
            && align_of::<Desc<Entry>>() == align_of::<RawDesc>()
    );
    assert!(size_of::<Desc<TaskEntry>>() == size_of::<RawDesc>());
    assert!(size_of::<Desc<InitEntry>>() == size_of::<RawDesc>());
};

/// The descriptor of `entry::<J, A>`.
struct EntryDesc<J, A>(std::marker::PhantomData<(J, A)>);

impl<J: Job<A>, A: DeserializeOwned> EntryDesc<J, A> {
    const DESC: &'static Desc<Entry> = &Desc::new(std::any::type_name::<(J, A)>, entry::<J, A>);
}

/// The name of `J`'s entry with arguments `A`.
pub(crate) fn entry_name<J: Job<A>, A: DeserializeOwned>() -> Result<JobName> {
    JobName::of(EntryDesc::<J, A>::DESC)
}

static TRUST_PATHS: AtomicBool = AtomicBool::new(false);

/// Lets a job whose code lies in a shared library without a GNU build-id be named by the
/// library's path alone.
///
/// A worker checks that the object holding a job's code is the same build as its parent's
/// before it runs anything in it (see [the crate docs](crate#who-is-a-worker-and-what-it-runs)): the executable
/// by its file and build-id, a shared library by its build-id. A library linked without one
/// (`-Wl,--build-id=none`, some custom toolchains) leaves nothing to check, so naming a job
/// in it is an error unless the program calls this first. Linux toolchains write build-ids
/// by default; prefer adding `-C link-arg=-Wl,--build-id` to calling this.
///
/// # Safety
/// Every shared library without a build-id that holds the code of a job (a closure given
/// to [`spawn`](crate::spawn), [`start_processes`](crate::start_processes) or a
/// [`Pool`](crate::Pool)) must be the very same file, at the same path, in every worker as
/// in the process that names the job: not rebuilt, replaced or shadowed (`LD_LIBRARY_PATH`)
/// in between. Otherwise a worker may run unrelated code.
pub unsafe fn trust_libraries_without_build_id() {
    TRUST_PATHS.store(true, Ordering::Relaxed);
}

/// How a parent names a job to its worker (see the module docs).
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub(crate) struct JobName {
    object: ObjectName,
    /// The object's GNU build-id; for a library, `None` only by
    /// [`trust_libraries_without_build_id`].
    build_id: Option<Vec<u8>>,
    /// The descriptor's offset from the object's load address.
    offset: u64,
    /// FNV-1a of the job's type name.
    type_hash: u64,
}

/// FNV-1a, 64 bits: stable, and the same in every process.
fn fnv1a(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
}

impl JobName {
    /// The name of the job `desc` describes.
    pub(crate) fn of<F: EntryFn>(desc: &'static Desc<F>) -> Result<JobName> {
        let addr = desc as *const Desc<F> as usize;
        let at = image::locate(addr, std::mem::size_of::<Desc<F>>()).ok_or_else(|| {
            Error::Unsupported(format!(
                "the code of {} is in no object the dynamic loader reports, so a worker could not find it",
                F::WHAT
            ))
        })?;
        if matches!(at.object, ObjectName::Library(_))
            && at.build_id.is_none()
            && !TRUST_PATHS.load(Ordering::Relaxed)
        {
            return Err(Error::Unsupported(format!(
                "the code of {} is in {}, which has no GNU build-id, so a worker cannot check that it \
                 loaded the same build; link it with -Wl,--build-id, or see \
                 tensorshare::trust_libraries_without_build_id",
                F::WHAT,
                at.object
            )));
        }
        Ok(JobName {
            object: at.object,
            build_id: at.build_id,
            offset: at.offset as u64,
            type_hash: fnv1a((desc.type_name)()),
        })
    }

    /// The function this name names in this process, after the checks of the module docs
    /// (the executable's identity is the caller's: the handshake, or a fork).
    pub(crate) fn resolve<F: EntryFn>(&self) -> std::result::Result<F, String> {
        let what = F::WHAT;
        let offset = usize::try_from(self.offset).map_err(|_| format!("{what} named outside memory"))?;
        let mut bytes = [0u8; std::mem::size_of::<RawDesc>()];
        let build_id = image::read(&self.object, offset, &mut bytes).map_err(|m| match m {
            Missing::NotLoaded => format!(
                "{what} lives in {}, which this worker has not loaded; load it before calling \
                 tensorshare::init()",
                self.object
            ),
            Missing::OutsideObject => format!("{what} is named outside {}", self.object),
        })?;
        if self.build_id.is_some() && build_id != self.build_id {
            return Err(format!(
                "{what} lives in {}, which is another build in this worker than in its parent \
                 (build-id {} here, {} there)",
                self.object,
                build_id.as_deref().map_or_else(|| "none".into(), image::hex),
                self.build_id.as_deref().map_or_else(|| "none".into(), image::hex),
            ));
        }
        // SAFETY: RawDesc is `repr(C)` plain integers without padding, for which every byte
        // pattern is valid, and `bytes` has exactly its size.
        let raw: RawDesc =
            unsafe { std::mem::transmute::<[u8; std::mem::size_of::<RawDesc>()], RawDesc>(bytes) };
        if raw.magic != MAGIC || raw.kind != F::KIND {
            return Err(format!("the name of {what} does not point at one in {}", self.object));
        }
        // SAFETY: the bytes carry the 128-bit magic and the kind of a descriptor, in an
        // object that is the same build as the parent's (its build-id, or for the
        // executable the identity the handshake checked; a library without a build-id only
        // under the caller's promise of `trust_libraries_without_build_id`), at the offset
        // where the parent found its descriptor: they are a `Desc<F>` the compiler made,
        // relocated by the loader, so `type_name` is a `fn() -> &'static str` of this
        // process.
        let type_name = unsafe { std::mem::transmute::<usize, fn() -> &'static str>(raw.type_name) };
        if fnv1a(type_name()) != self.type_hash {
            return Err(format!("the name of {what} points at another job ({})", type_name()));
        }
        // SAFETY: as above, the descriptor is a `Desc<F>` (its kind is F's), so `f` is an
        // `F`, a function pointer of the same size as usize (checked at compile time).
        Ok(unsafe { std::mem::transmute_copy::<usize, F>(&raw.f) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn probe_job(_rank: usize, _: u8) {}

    /// The name of `job`'s entry, and the entry its descriptor holds.
    fn named<J: Job<A>, A: DeserializeOwned>(_job: J) -> (JobName, usize) {
        (entry_name::<J, A>().unwrap(), EntryDesc::<J, A>::DESC.f as usize)
    }

    fn refused<F: EntryFn>(name: &JobName) -> String {
        match name.resolve::<F>() {
            Ok(_) => panic!("{name:?} resolved"),
            Err(e) => e,
        }
    }

    #[test]
    fn a_name_resolves_to_its_entry() {
        let (name, f) = named(probe_job);
        assert_eq!(name.object, ObjectName::Executable);
        assert_eq!(name.resolve::<Entry>().unwrap() as usize, f);
    }

    #[test]
    fn a_name_that_points_elsewhere_is_refused_not_called() {
        let (name, _) = named(probe_job);
        for offset in [name.offset + 8, name.offset - 8, 0, 1] {
            let e = refused::<Entry>(&JobName { offset, ..name.clone() });
            assert!(e.contains("does not point at one") || e.contains("named outside"), "{e}");
        }
        let e = refused::<Entry>(&JobName { offset: u64::MAX - 8, ..name.clone() });
        assert!(e.contains("named outside"), "{e}");
    }

    #[test]
    fn a_name_of_another_kind_or_type_is_refused() {
        let (name, _) = named(probe_job);
        assert!(refused::<TaskEntry>(&name).contains("does not point at one"));
        assert!(refused::<InitEntry>(&name).contains("does not point at one"));
        let e = refused::<Entry>(&JobName { type_hash: name.type_hash ^ 1, ..name.clone() });
        assert!(e.contains("points at another job"), "{e}");
    }

    #[test]
    fn a_name_in_another_build_or_object_is_refused() {
        let (name, _) = named(probe_job);
        let other = JobName { build_id: Some(vec![0; 20]), ..name.clone() };
        assert!(refused::<Entry>(&other).contains("another build"));
        let lib = JobName { object: ObjectName::Library(b"/nonexistent/libjobs.so".to_vec()), ..name };
        assert!(refused::<Entry>(&lib).contains("has not loaded"));
    }
}
