//! [`Message`]: a value as the bytes and descriptors that carry it, for transports that are
//! not tensorshare's own channels.
//!
//! A queue, a pipe and a process argument already carry values; this is for the rest: a
//! foreign runtime's process launcher that passes descriptors itself (Python's
//! `multiprocessing` hands a child its descriptors through `pass_fds` or its fork server, and
//! the Python package uses this to send a queue to a child that way), or a socket of your
//! own. The bytes are the wire format described in the README's "Wire format"; the
//! descriptors must reach the receiver in the same order (SCM_RIGHTS, inheritance, a
//! `pidfd_getfd`), as descriptors for the same open files.
//!
//! A message is self-contained: the slots of shared memory it names are held through its own
//! descriptors, so its sender may exit, and a message that is never decoded gives them back
//! when its descriptors close. Decoding checks every handle, as receiving does: a replayed,
//! duplicated or forged message is an error or adds holds, never undefined behaviour.

use std::io::Write;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::process::Command;

use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::{Error, Result};

/// Most bytes of a message handed to a process in its environment as hex (see
/// [`Message::pass_to`]); a larger one's bytes go in a memfd.
pub const ENV_INLINE_MAX: usize = 16 << 10;

/// Most bytes a handed message's memfd may hold for [`Message::from_env`] to read.
const HANDED_MAX: u64 = 1 << 30;

/// The bytes of the file `fd` from its start, read at offsets (the description is shared
/// with the parent and any sibling started from the same command, so its offset is not
/// used), up to [`HANDED_MAX`].
fn read_handed_bytes(fd: OwnedFd) -> std::io::Result<Vec<u8>> {
    use std::os::unix::fs::FileExt;
    let file = std::fs::File::from(fd);
    let len = file.metadata()?.len();
    if len > HANDED_MAX {
        return Err(std::io::Error::other(format!("{len} bytes, more than {HANDED_MAX}")));
    }
    let mut bytes = vec![0u8; usize::try_from(len).map_err(std::io::Error::other)?];
    file.read_exact_at(&mut bytes, 0)?;
    Ok(bytes)
}

/// A value turned into bytes plus the descriptors that travel with them.
#[derive(Debug)]
pub struct Message {
    bytes: Vec<u8>,
    fds: Vec<OwnedFd>,
}

impl Message {
    /// `value` as a message. Tensors become handles to shared memory (a private storage is
    /// moved into shared memory first, in place, as sending it on a queue would). For CUDA
    /// tensors this waits for the work queued on their devices' tensorshare streams: a
    /// receiver sees what was written up to the encoding, not up to the message's delivery.
    pub fn encode<T: Serialize + ?Sized>(value: &T) -> Result<Message> {
        let msg = crate::wire::encode(value)?;
        let fds = msg
            .borrowed_fds()
            .iter()
            .map(|f| f.try_clone_to_owned().map_err(|e| Error::io("dup a message's descriptor", e)))
            .collect::<Result<_>>()?;
        Ok(Message { bytes: msg.bytes, fds })
    }

    /// A message received by other means: its bytes and its descriptors, in order.
    pub fn from_parts(bytes: Vec<u8>, fds: Vec<OwnedFd>) -> Message {
        Message { bytes, fds }
    }

    /// The bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// The descriptors, in the order the bytes name them.
    pub fn fds(&self) -> &[OwnedFd] {
        &self.fds
    }

    /// The bytes and the descriptors.
    pub fn into_parts(self) -> (Vec<u8>, Vec<OwnedFd>) {
        (self.bytes, self.fds)
    }

    /// The value back, checked as a received message is ([`Error::InvalidMessage`] when it
    /// is malformed); this process takes its own holds on what it keeps.
    pub fn decode<T: DeserializeOwned>(self) -> Result<T> {
        crate::wire::decode(&self.bytes, self.fds, false)
    }

    /// Hands this message to the program `cmd` will start: its descriptors are inherited
    /// (open in the child at the same numbers) and the environment variable `var` names
    /// them with the bytes, for [`Message::from_env`] in a Rust child or
    /// `tensorshare.inherited()` in a Python one. The message lives in `cmd` until it is
    /// dropped, so every process started from it gets the same value. Bytes beyond
    /// [`ENV_INLINE_MAX`] go in a memfd the child inherits too (Linux caps one environment
    /// string at 128 KiB): an error only when it cannot be made.
    pub fn pass_to(self, cmd: &mut Command, var: &str) -> Result<()> {
        let mut fds = self.fds;
        let text = if self.bytes.len() <= ENV_INLINE_MAX {
            Message::text(&self.bytes, &fds)
        } else {
            let flags = rustix::fs::MemfdFlags::CLOEXEC | rustix::fs::MemfdFlags::ALLOW_SEALING;
            let file = rustix::fs::memfd_create("tensorshare-handoff", flags).map_err(|e| {
                Error::io("make a memfd for a value handed to a process", std::io::Error::from(e))
            })?;
            std::fs::File::from(file.try_clone().map_err(|e| Error::io("dup a memfd", e))?)
                .write_all(&self.bytes)
                .map_err(|e| Error::io("write a value handed to a process", e))?;
            // Sealed: every child started from `cmd` reads the same bytes, whatever one does.
            let seals = rustix::fs::SealFlags::WRITE
                | rustix::fs::SealFlags::SHRINK
                | rustix::fs::SealFlags::GROW
                | rustix::fs::SealFlags::SEAL;
            rustix::fs::fcntl_add_seals(&file, seals)
                .map_err(|e| Error::io("seal a value handed to a process", std::io::Error::from(e)))?;
            let text = format!("@{}:{}", file.as_raw_fd(), Message::fd_list(&fds));
            fds.push(file);
            text
        };
        cmd.env(var, text);
        // SAFETY: the hook runs in the child between fork and exec, where only
        // async-signal-safe calls are allowed: it makes only fcntl calls, on descriptors
        // that `fds` (moved into the hook, so alive as long as `cmd`) keeps open in the
        // parent and that the fork copied.
        unsafe {
            cmd.pre_exec(move || {
                for fd in &fds {
                    let raw = fd.as_raw_fd();
                    let flags = libc::fcntl(raw, libc::F_GETFD);
                    if flags < 0 || libc::fcntl(raw, libc::F_SETFD, flags & !libc::FD_CLOEXEC) < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                Ok(())
            });
        }
        Ok(())
    }

    /// What [`pass_to`](Self::pass_to) puts in the environment for a message of at most
    /// [`ENV_INLINE_MAX`] bytes: the bytes in hex, a colon, and the descriptor numbers
    /// separated by commas. (A larger one's bytes are in a memfd: `@`, its number, a colon,
    /// and the descriptor numbers.)
    pub fn env_text(&self) -> String {
        Message::text(&self.bytes, &self.fds)
    }

    fn text(bytes: &[u8], fds: &[OwnedFd]) -> String {
        let mut text = String::with_capacity(bytes.len() * 2 + 1 + fds.len() * 4);
        for b in bytes {
            text.push_str(&format!("{b:02x}"));
        }
        text.push(':');
        text.push_str(&Message::fd_list(fds));
        text
    }

    fn fd_list(fds: &[OwnedFd]) -> String {
        fds.iter().map(|f| f.as_raw_fd().to_string()).collect::<Vec<_>>().join(",")
    }

    /// The message a parent handed to this process in the environment variable `var`
    /// ([`pass_to`](Self::pass_to) from Rust, `tensorshare.popen` from Python). A malformed
    /// text is [`Error::InvalidMessage`]. The variable is taken out of the environment, and
    /// the adopted descriptors are closed on `exec`, so that processes this one starts see
    /// neither (as Python's `tensorshare.inherited` does).
    ///
    /// # Safety
    /// The descriptors the variable names must have been inherited for this message and be
    /// owned by nothing else in this process: they are adopted, and closed when the message
    /// is dropped. Call it once per variable, while no other thread reads or changes the
    /// environment (first thing in `main`): it removes `var`, and the C library's
    /// environment is not safe to change while another thread reads it.
    pub unsafe fn from_env(var: &str) -> Result<Message> {
        let text = std::env::var(var)
            .map_err(|e| Error::InvalidMessage(format!("environment variable {var}: {e}")))?;
        std::env::remove_var(var);
        let (hex, fds) =
            text.split_once(':').ok_or_else(|| Error::InvalidMessage(format!("{var} is not BYTES:FDS")))?;
        // The bytes in a memfd (`@N`), read once the descriptors are adopted, or in hex.
        let in_file = match hex.strip_prefix('@') {
            Some(n) => Some(n.parse::<RawFd>().ok().filter(|&n| n >= 0).ok_or_else(|| {
                Error::InvalidMessage(format!("{var}: bad descriptor {n:?} for the bytes"))
            })?),
            None => None,
        };
        if in_file.is_none() && hex.len() % 2 != 0 {
            return Err(Error::InvalidMessage(format!("{var}: odd number of hex digits")));
        }
        let bytes = match in_file {
            Some(_) => Vec::new(),
            None => (0..hex.len())
                .step_by(2)
                .map(|i| u8::from_str_radix(&hex[i..i + 2], 16))
                .collect::<std::result::Result<Vec<u8>, _>>()
                .map_err(|e| Error::InvalidMessage(format!("{var}: {e}")))?,
        };
        let raw: Vec<RawFd> = if fds.is_empty() {
            Vec::new()
        } else {
            fds.split(',')
                .map(|f| f.parse::<RawFd>().ok().filter(|&n| n >= 0))
                .collect::<Option<_>>()
                .ok_or_else(|| Error::InvalidMessage(format!("{var}: bad descriptor list {fds:?}")))?
        };
        let mut seen: Vec<RawFd> = raw.iter().copied().chain(in_file).collect();
        seen.sort_unstable();
        seen.dedup();
        if seen.len() != raw.len() + usize::from(in_file.is_some()) {
            return Err(Error::InvalidMessage(format!(
                "{var}: a descriptor named twice in {fds:?} (the bytes' descriptor included)"
            )));
        }
        for &fd in raw.iter().chain(in_file.as_ref()) {
            // SAFETY: F_GETFD only reads the descriptor table.
            if unsafe { libc::fcntl(fd, libc::F_GETFD) } < 0 {
                return Err(Error::InvalidMessage(format!("{var}: descriptor {fd} is not open")));
            }
        }
        // SAFETY: the caller promises these descriptors were inherited for this message and
        // are owned by nothing else here; each was checked open above.
        let fds: Vec<OwnedFd> = raw.into_iter().map(|fd| unsafe { OwnedFd::from_raw_fd(fd) }).collect();
        // SAFETY: as the message's descriptors: the caller promises the bytes' memfd was
        // inherited for this message and is owned by nothing else here; it was checked open
        // above, and named once. Adopted with them, so that an error below closes it too.
        let file = in_file.map(|n| unsafe { OwnedFd::from_raw_fd(n) });
        for fd in fds.iter().chain(file.as_ref()) {
            rustix::io::fcntl_setfd(fd, rustix::io::FdFlags::CLOEXEC)
                .map_err(|e| Error::InvalidMessage(format!("{var}: descriptor {}: {e}", fd.as_raw_fd())))?;
        }
        let bytes = match file {
            Some(file) => {
                let n = file.as_raw_fd();
                read_handed_bytes(file)
                    .map_err(|e| Error::InvalidMessage(format!("{var}: the bytes in descriptor {n}: {e}")))?
            }
            None => bytes,
        };
        Ok(Message { bytes, fds })
    }
}
