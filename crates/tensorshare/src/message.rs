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

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::process::Command;

use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::{Error, Result};

/// A value turned into bytes plus the descriptors that travel with them.
#[derive(Debug)]
pub struct Message {
    bytes: Vec<u8>,
    fds: Vec<OwnedFd>,
}

impl Message {
    /// `value` as a message. Tensors become handles to shared memory (a private storage is
    /// moved into shared memory first, in place, as sending it on a queue would).
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
    /// dropped, so every process started from it gets the same value.
    pub fn pass_to(self, cmd: &mut Command, var: &str) {
        cmd.env(var, self.env_text());
        let fds = self.fds;
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
    }

    /// What [`pass_to`](Self::pass_to) puts in the environment: the bytes in hex, a colon,
    /// and the descriptor numbers separated by commas.
    pub fn env_text(&self) -> String {
        let mut text = String::with_capacity(self.bytes.len() * 2 + 1 + self.fds.len() * 4);
        for b in &self.bytes {
            text.push_str(&format!("{b:02x}"));
        }
        text.push(':');
        let fds: Vec<String> = self.fds.iter().map(|f| f.as_raw_fd().to_string()).collect();
        text.push_str(&fds.join(","));
        text
    }

    /// The message a parent handed to this process in the environment variable `var`
    /// ([`pass_to`](Self::pass_to) from Rust, `tensorshare.popen` from Python). A malformed
    /// text is [`Error::InvalidMessage`].
    ///
    /// # Safety
    /// The descriptors the variable names must have been inherited for this message and be
    /// owned by nothing else in this process: they are adopted, and closed when the message
    /// is dropped. Call it once per variable.
    pub unsafe fn from_env(var: &str) -> Result<Message> {
        let text = std::env::var(var)
            .map_err(|e| Error::InvalidMessage(format!("environment variable {var}: {e}")))?;
        let (hex, fds) =
            text.split_once(':').ok_or_else(|| Error::InvalidMessage(format!("{var} is not BYTES:FDS")))?;
        if hex.len() % 2 != 0 {
            return Err(Error::InvalidMessage(format!("{var}: odd number of hex digits")));
        }
        let bytes = (0..hex.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&hex[i..i + 2], 16))
            .collect::<std::result::Result<Vec<u8>, _>>()
            .map_err(|e| Error::InvalidMessage(format!("{var}: {e}")))?;
        let raw: Vec<RawFd> = if fds.is_empty() {
            Vec::new()
        } else {
            fds.split(',')
                .map(|f| f.parse::<RawFd>().ok().filter(|&n| n >= 0))
                .collect::<Option<_>>()
                .ok_or_else(|| Error::InvalidMessage(format!("{var}: bad descriptor list {fds:?}")))?
        };
        let mut seen = raw.clone();
        seen.sort_unstable();
        seen.dedup();
        if seen.len() != raw.len() {
            return Err(Error::InvalidMessage(format!("{var}: a descriptor named twice in {fds:?}")));
        }
        for &fd in &raw {
            // SAFETY: F_GETFD only reads the descriptor table.
            if unsafe { libc::fcntl(fd, libc::F_GETFD) } < 0 {
                return Err(Error::InvalidMessage(format!("{var}: descriptor {fd} is not open")));
            }
        }
        // SAFETY: the caller promises these descriptors were inherited for this message and
        // are owned by nothing else here; each was checked open above.
        let fds = raw.into_iter().map(|fd| unsafe { OwnedFd::from_raw_fd(fd) }).collect();
        Ok(Message { bytes, fds })
    }
}
