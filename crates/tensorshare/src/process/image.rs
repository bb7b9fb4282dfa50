//! Which code this process runs: the identity of its executable, and the objects the
//! dynamic loader mapped into it (the executable and its shared libraries), read with
//! `dl_iterate_phdr`.
//!
//! A parent names a job to its worker by the loaded object that holds the job's code and
//! an offset in that object (see `job`): the loader maps every object at an address of its
//! own, randomised per process, so an address means something in another process only
//! relative to the object it lies in. Before a worker reads anything at such an offset it
//! checks that the object is the same build as its parent's: the executable by its file
//! (device, inode, size) and GNU build-id, sent in the worker's hello (see `handshake`),
//! and a shared library by its build-id, sent with the name.

use std::ffi::{c_int, c_void, CStr};

use serde::{Deserialize, Serialize};

/// The note type of a GNU build-id.
const NT_GNU_BUILD_ID: u32 = 3;

#[cfg(target_pointer_width = "64")]
type Phdr = libc::Elf64_Phdr;
#[cfg(target_pointer_width = "32")]
type Phdr = libc::Elf32_Phdr;

/// The identity of a process's executable: the file it was started from and, when the
/// linker wrote one, its GNU build-id.
///
/// Workers are started from `/proc/self/exe`, the very file the parent runs, which
/// nobody can rewrite while a process runs it (ETXTBSY), so a worker whose file differs
/// from its parent's was not started by that parent from this program.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ExeId {
    dev: u64,
    ino: u64,
    size: u64,
    build_id: Option<Vec<u8>>,
}

impl ExeId {
    /// This process's executable (computed once).
    pub(crate) fn current() -> Result<&'static ExeId, String> {
        static ID: crate::util::Lazy<Result<ExeId, String>> = crate::util::Lazy::new();
        ID.get_or_make(|| {
            let st =
                rustix::fs::stat("/proc/self/exe").map_err(|e| format!("cannot stat /proc/self/exe: {e}"))?;
            let mut build_id = None;
            each_object(&mut |o| {
                // The loader reports the executable first.
                build_id = o.build_id();
                true
            });
            Ok(ExeId { dev: st.st_dev as u64, ino: st.st_ino as u64, size: st.st_size as u64, build_id })
        })
        .as_ref()
        .map_err(Clone::clone)
    }

    /// The form sent in a hello: `<dev>:<ino>:<size>:<build-id in hex, or ->`.
    pub(crate) fn to_text(&self) -> String {
        let build_id = self.build_id.as_deref().map_or_else(|| "-".to_string(), hex);
        format!("{}:{}:{}:{build_id}", self.dev, self.ino, self.size)
    }

    /// Parses [`ExeId::to_text`]'s form.
    pub(crate) fn parse(s: &str) -> Option<ExeId> {
        let mut parts = s.split(':');
        let dev = parts.next()?.parse().ok()?;
        let ino = parts.next()?.parse().ok()?;
        let size = parts.next()?.parse().ok()?;
        let build_id = match parts.next()? {
            "-" => None,
            h => Some(unhex(h)?),
        };
        parts.next().is_none().then_some(ExeId { dev, ino, size, build_id })
    }
}

impl std::fmt::Display for ExeId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "file {:#x}:{} of {} bytes, build-id ", self.dev, self.ino, self.size)?;
        match &self.build_id {
            Some(b) => f.write_str(&hex(b)),
            None => f.write_str("none"),
        }
    }
}

/// Lower-case hex of `bytes`.
pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The bytes of lower- or upper-case hex `s`, if it is that.
pub(crate) fn unhex(s: &str) -> Option<Vec<u8>> {
    if s.len() % 2 != 0 || !s.is_ascii() {
        return None;
    }
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).ok()).collect()
}

/// A loaded object, named so that another process running the same program finds it: the
/// executable, or a shared library by the path the loader reports for it.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub(crate) enum ObjectName {
    Executable,
    Library(Vec<u8>),
}

impl std::fmt::Display for ObjectName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ObjectName::Executable => f.write_str("the executable"),
            ObjectName::Library(p) => write!(f, "the shared library {}", String::from_utf8_lossy(p)),
        }
    }
}

/// Where an address lies.
pub(crate) struct Located {
    pub(crate) object: ObjectName,
    pub(crate) build_id: Option<Vec<u8>>,
    /// From the object's load address.
    pub(crate) offset: usize,
}

/// The object that holds `[addr, addr + len)` in a readable segment, if one does.
pub(crate) fn locate(addr: usize, len: usize) -> Option<Located> {
    let mut found = None;
    each_object(&mut |o| {
        if !o.readable(addr, len) {
            return false;
        }
        let object = if o.first { ObjectName::Executable } else { ObjectName::Library(o.name.to_vec()) };
        // A readable segment holds `addr`, so it is at least the load address.
        found = Some(Located { object, build_id: o.build_id(), offset: addr - o.base });
        true
    });
    found
}

/// Why [`read`] found nothing.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Missing {
    /// No loaded object has that name.
    NotLoaded,
    /// The object is loaded, but no readable segment of it holds the range.
    OutsideObject,
}

/// Copies the bytes at `offset` in the loaded object `name` into `buf`, and returns the
/// object's build-id; only when a readable segment of the object holds them all.
///
/// The bytes are read with volatile reads of plain bytes: whatever they are, reading them
/// only copies them (the caller decides what they mean).
pub(crate) fn read(name: &ObjectName, offset: usize, buf: &mut [u8]) -> Result<Option<Vec<u8>>, Missing> {
    let mut result = Err(Missing::NotLoaded);
    each_object(&mut |o| {
        let matches = match name {
            ObjectName::Executable => o.first,
            ObjectName::Library(path) => !o.first && o.name == path.as_slice(),
        };
        if !matches {
            return false;
        }
        result = match o.base.checked_add(offset) {
            Some(addr) if o.readable(addr, buf.len()) => {
                for (i, b) in buf.iter_mut().enumerate() {
                    // SAFETY: `addr + i` lies in a PT_LOAD segment of an object the loader
                    // has mapped readable (checked just above), and the object cannot be
                    // unloaded while this callback runs (dl_iterate_phdr holds the loader's
                    // lock), so the read cannot fault; a volatile read of a `u8` makes no
                    // assumption about the value or about the memory's other users.
                    *b =
                        unsafe { std::ptr::read_volatile(std::ptr::with_exposed_provenance::<u8>(addr + i)) };
                }
                Ok(o.build_id())
            }
            _ => Err(Missing::OutsideObject),
        };
        true
    });
    result
}

/// One loaded object, as `dl_iterate_phdr` reports it.
struct Loaded<'a> {
    /// The loader reports the executable first.
    first: bool,
    name: &'a [u8],
    /// The load bias: run-time address = `base` + the address in the file.
    base: usize,
    phdrs: &'a [Phdr],
}

impl Loaded<'_> {
    /// Whether a readable PT_LOAD segment holds `[addr, addr + len)` whole.
    fn readable(&self, addr: usize, len: usize) -> bool {
        let Some(end) = addr.checked_add(len) else { return false };
        self.phdrs.iter().any(|p| {
            if p.p_type != libc::PT_LOAD || p.p_flags & libc::PF_R == 0 {
                return false;
            }
            let Some(start) = self.base.checked_add(p.p_vaddr as usize) else { return false };
            start.checked_add(p.p_memsz as usize).is_some_and(|stop| start <= addr && end <= stop)
        })
    }

    /// The object's GNU build-id, from its notes, which the loader maps with it.
    fn build_id(&self) -> Option<Vec<u8>> {
        self.phdrs.iter().filter(|p| p.p_type == libc::PT_NOTE).find_map(|p| {
            let start = self.base.checked_add(p.p_vaddr as usize)?;
            let len = p.p_memsz as usize;
            if !self.readable(start, len) {
                return None;
            }
            // SAFETY: the range lies in a readable PT_LOAD segment of this object (checked
            // above), which stays mapped while the loader's lock is held (we are inside
            // dl_iterate_phdr's callback); notes are never written after loading.
            let notes =
                unsafe { std::slice::from_raw_parts(std::ptr::with_exposed_provenance::<u8>(start), len) };
            build_id_in(notes, p.p_align as usize)
        })
    }
}

/// The GNU build-id in a note segment whose entries are padded to `align` (4 or 8).
fn build_id_in(mut notes: &[u8], align: usize) -> Option<Vec<u8>> {
    let align = if align == 8 { 8 } else { 4 };
    let pad = |n: usize| n.checked_add(align - 1).map(|n| n & !(align - 1));
    let word = |b: &[u8], at: usize| -> Option<usize> {
        Some(u32::from_ne_bytes(b.get(at..at + 4)?.try_into().ok()?) as usize)
    };
    while notes.len() >= 12 {
        let (namesz, descsz, kind) = (word(notes, 0)?, word(notes, 4)?, word(notes, 8)?);
        // The name follows the 12-byte header; the descriptor and the next note start at
        // the next multiple of the alignment.
        let desc_at = pad(12usize.checked_add(namesz)?)?;
        let next = pad(desc_at.checked_add(descsz)?)?;
        let name = notes.get(12..12usize.checked_add(namesz)?)?;
        let desc = notes.get(desc_at..desc_at.checked_add(descsz)?)?;
        if kind == NT_GNU_BUILD_ID as usize && name == b"GNU\0" {
            return Some(desc.to_vec());
        }
        notes = notes.get(next..)?;
    }
    None
}

/// Calls `f` for each loaded object, the executable first, until it returns true.
///
/// `f` runs under the loader's lock: it must not load or unload objects, and must not
/// panic (a panic cannot unwind through the C caller, so it aborts).
fn each_object(f: &mut dyn FnMut(&Loaded<'_>) -> bool) {
    struct State<'f> {
        f: &'f mut dyn FnMut(&Loaded<'_>) -> bool,
        seen: usize,
    }

    unsafe extern "C" fn callback(info: *mut libc::dl_phdr_info, _size: usize, data: *mut c_void) -> c_int {
        // SAFETY: `data` is the `State` that `each_object` passed, alive and not otherwise
        // borrowed for the whole dl_iterate_phdr call.
        let state = unsafe { &mut *data.cast::<State<'_>>() };
        // SAFETY: the loader passes a valid dl_phdr_info for the duration of the callback.
        let info = unsafe { &*info };
        let name = if info.dlpi_name.is_null() {
            &[][..]
        } else {
            // SAFETY: a non-null dlpi_name is a NUL-terminated string owned by the loader,
            // valid while the object is loaded (it cannot be unloaded during the callback).
            unsafe { CStr::from_ptr(info.dlpi_name) }.to_bytes()
        };
        let phdrs = if info.dlpi_phdr.is_null() {
            &[][..]
        } else {
            // SAFETY: dlpi_phdr points to the object's dlpi_phnum program headers, mapped
            // with the object for as long as it is loaded.
            unsafe { std::slice::from_raw_parts(info.dlpi_phdr, usize::from(info.dlpi_phnum)) }
        };
        let loaded = Loaded { first: state.seen == 0, name, base: info.dlpi_addr as usize, phdrs };
        state.seen += 1;
        c_int::from((state.f)(&loaded))
    }

    let mut state = State { f, seen: 0 };
    // Every fork waits for this read to end (see `READING`).
    let _reading = crate::util::lock(&READING);
    // SAFETY: the callback matches dl_iterate_phdr's contract and only reads what the
    // loader passes it; `state` outlives the call.
    unsafe { libc::dl_iterate_phdr(Some(callback), (&mut state as *mut State<'_>).cast::<c_void>()) };
}

/// Held while this process reads the loader's list: glibc locks the list for the read, and
/// a child forked meanwhile finds that lock held by a thread it lacks, for good (glibc 2.36
/// does not reset it in the child), so its own first read would wait forever (a child
/// forked while another thread founded the cleanup group, which reads it to name the
/// executable to its cleaner, hung so). Taken around every fork, as the layers' other locks
/// are, so no fork comes in the middle of a read. `f` takes no lock under it.
static READING: std::sync::Mutex<()> = std::sync::Mutex::new(());

crate::util::fork::guard_at_load!(crate::util::fork::Rank::Loader, |out| out
    .push(Box::new(crate::util::lock(&READING))));

#[cfg(test)]
mod tests {
    use super::*;

    fn note(name: &[u8], kind: u32, desc: &[u8], align: usize) -> Vec<u8> {
        let mut v = Vec::new();
        v.extend((name.len() as u32).to_ne_bytes());
        v.extend((desc.len() as u32).to_ne_bytes());
        v.extend(kind.to_ne_bytes());
        v.extend(name);
        v.resize(v.len().next_multiple_of(align), 0);
        v.extend(desc);
        v.resize(v.len().next_multiple_of(align), 0);
        v
    }

    #[test]
    fn build_id_is_found_after_other_notes() {
        for align in [4, 8] {
            let mut notes = note(b"GNU\0", 1, &[0, 0, 0, 0, 3, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0], align);
            notes.extend(note(b"GNU\0", NT_GNU_BUILD_ID, &[0xab; 20], align));
            assert_eq!(build_id_in(&notes, align), Some(vec![0xab; 20]));
        }
    }

    #[test]
    fn truncated_or_foreign_notes_have_no_build_id() {
        let notes = note(b"GNU\0", NT_GNU_BUILD_ID, &[1; 20], 4);
        assert_eq!(build_id_in(&notes[..notes.len() - 4], 4), None);
        assert_eq!(build_id_in(&note(b"XYZ\0", NT_GNU_BUILD_ID, &[1; 20], 4), 4), None);
        let mut huge = note(b"GNU\0", NT_GNU_BUILD_ID, &[1; 4], 4);
        huge[4..8].copy_from_slice(&u32::MAX.to_ne_bytes());
        assert_eq!(build_id_in(&huge, 4), None);
    }

    #[test]
    fn exe_id_round_trips_and_rejects_junk() {
        let me = ExeId::current().unwrap();
        assert_eq!(ExeId::parse(&me.to_text()).as_ref(), Some(me));
        for junk in ["", "1:2:3", "1:2:3:-:5", "a:2:3:-", "1:2:3:abc", "1:2:3:zz"] {
            assert_eq!(ExeId::parse(junk), None, "{junk:?}");
        }
    }

    #[test]
    fn a_static_of_this_executable_is_located_and_read_back() {
        static PROBE: [u8; 8] = *b"probe!!!";
        let addr = std::ptr::addr_of!(PROBE) as usize;
        let loc = locate(addr, 8).expect("a static of this executable is in it");
        assert_eq!(loc.object, ObjectName::Executable);
        let mut buf = [0u8; 8];
        let build_id = read(&loc.object, loc.offset, &mut buf).unwrap();
        assert_eq!(&buf, b"probe!!!");
        assert_eq!(build_id, loc.build_id);
        assert_eq!(read(&loc.object, usize::MAX - 4, &mut buf), Err(Missing::OutsideObject));
        assert_eq!(
            read(&ObjectName::Library(b"/nonexistent.so".to_vec()), 0, &mut buf),
            Err(Missing::NotLoaded)
        );
    }
}
