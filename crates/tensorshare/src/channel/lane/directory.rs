//! The lane's directory: the send descriptions that hold lane messages, parked in a socket.
//!
//! A queue's socket pair carries records from the producers' end (`tx`) to the consumers'
//! end (`rx`); nothing goes the other way, so `tx`'s own receive queue is free. The
//! directory is that queue: a description is parked by sending it from `rx` (one entry: a
//! record of its window, the arena's identity, the description's tag and the arena's name,
//! with the descriptor attached), and
//! lives in the socket's buffer, held by the kernel, whoever dies. Entries are looked up with
//! `MSG_PEEK` at an offset (`SO_PEEK_OFF`), which leaves them in place, and taken out from
//! the front once their window is over (see `Ring::first_open_window`), peeked at with the
//! offset off and read with no room for their descriptors, which the kernel then keeps
//! queued or lets go itself. The peek offset belongs to the socket, so every look and every
//! removal happens under the directory's lock (an OFD write lock on a byte of the control
//! block, see `Control::with_directory`).
//!
//! Entries are what peers wrote: one that does not parse, or whose descriptor is not the
//! arena it claims, is skipped; one from a window that cannot have begun is taken out.

use std::io::{IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};

use rustix::io::Errno;
use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};

use crate::shm::FileId;
use crate::{Error, Result};

const VERSION: u8 = 2;
/// Bytes of an entry before its name: version, window, device, inode, tag, name length.
const ENTRY_HEAD: usize = 1 + 8 + 8 + 8 + 8 + 1;
/// Room for one entry: its head and a name.
const MAX_ENTRY: usize = ENTRY_HEAD + 255;
/// Most entries one look reads: a directory holds a few windows' worth per arena.
const MAX_LOOK: usize = 4096;

/// One parked description.
pub(crate) struct Entry {
    pub(crate) window: u64,
    pub(crate) id: FileId,
    /// The description's tag (see `Arena::send_hold`; 0 for none).
    pub(crate) tag: u64,
    pub(crate) fd: Option<OwnedFd>,
    /// Its descriptor could not be installed here (this process is at its descriptor
    /// limit).
    pub(crate) cut: bool,
}

fn encode(window: u64, id: FileId, tag: u64, name: Option<&str>) -> Result<Vec<u8>> {
    let name = name.unwrap_or("").as_bytes();
    let n = u8::try_from(name.len()).map_err(|_| Error::invalid("a segment name over 255 bytes"))?;
    let mut b = Vec::with_capacity(ENTRY_HEAD + name.len());
    b.push(VERSION);
    b.extend_from_slice(&window.to_le_bytes());
    b.extend_from_slice(&id.0.to_le_bytes());
    b.extend_from_slice(&id.1.to_le_bytes());
    b.extend_from_slice(&tag.to_le_bytes());
    b.push(n);
    b.extend_from_slice(name);
    Ok(b)
}

fn parse(b: &[u8], fd: Option<OwnedFd>) -> Option<Entry> {
    let word = |at: usize| b.get(at..at + 8).map(|w| u64::from_le_bytes(w.try_into().expect("8 bytes")));
    if b.first() != Some(&VERSION) {
        return None;
    }
    let (window, dev, ino, tag) = (word(1)?, word(9)?, word(17)?, word(25)?);
    let n = *b.get(ENTRY_HEAD - 1)? as usize;
    let name = b.get(ENTRY_HEAD..ENTRY_HEAD + n)?;
    if b.len() != ENTRY_HEAD + n {
        return None;
    }
    // The name is checked against the descriptor when the arena is mapped (see
    // `Segment::from_named_fd`); here it need only be text.
    std::str::from_utf8(name).ok()?;
    Some(Entry { window, id: (dev, ino), tag, fd, cut: false })
}

/// Parks `desc`, a description of the arena `id` (named `name`) tagged `tag`, for `window`,
/// by sending it from the consumers' end `rx` into the producers' end's receive queue.
pub(crate) fn park(
    rx: BorrowedFd<'_>,
    desc: BorrowedFd<'_>,
    window: u64,
    id: FileId,
    tag: u64,
    name: Option<&str>,
) -> Result<()> {
    let bytes = encode(window, id, tag, name)?;
    let fds = [desc];
    let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !control.push(SendAncillaryMessage::ScmRights(&fds)) {
        return Err(Error::io("parking a lane hold", Errno::NOBUFS));
    }
    rustix::net::sendmsg(
        rx,
        &[IoSlice::new(&bytes)],
        &mut control,
        SendFlags::DONTWAIT | SendFlags::NOSIGNAL,
    )
    .map_err(|e| Error::io("parking a lane hold (sendmsg)", e))?;
    Ok(())
}

/// Reads, in place, the entry of `tx`'s receive queue at the peek offset, which moves past
/// it. None when there are no more; `Some(None)` for a record that is not an entry.
fn peek(tx: BorrowedFd<'_>) -> Result<Option<Option<Entry>>> {
    let mut bytes = [0u8; MAX_ENTRY + 1];
    let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let flags = RecvFlags::DONTWAIT | RecvFlags::CMSG_CLOEXEC | RecvFlags::PEEK;
    let r = match rustix::net::recvmsg(tx, &mut [IoSliceMut::new(&mut bytes)], &mut control, flags) {
        Ok(r) => r,
        Err(Errno::AGAIN) => return Ok(None),
        Err(e) => return Err(Error::io("reading the lane's directory (recvmsg)", e)),
    };
    let mut fds: Vec<OwnedFd> = Vec::new();
    for m in control.drain() {
        if let RecvAncillaryMessage::ScmRights(rights) = m {
            fds.extend(rights);
        }
    }
    if r.bytes == 0 && fds.is_empty() {
        // A record of no bytes (only a peer writes one): not an entry, and not the end.
        return Ok(Some(None));
    }
    if r.flags.contains(ReturnFlags::TRUNC) {
        return Ok(Some(None));
    }
    if r.flags.contains(ReturnFlags::CTRUNC) && fds.is_empty() {
        return Ok(Some(parse(&bytes[..r.bytes], None).map(|e| Entry { cut: true, ..e })));
    }
    let fd = if fds.len() == 1 { fds.pop() } else { None };
    Ok(Some(if fd.is_some() { parse(&bytes[..r.bytes], fd) } else { None }))
}

/// Sets `tx`'s peek offset: reads with `MSG_PEEK` start that many bytes into its queue.
fn set_peek_offset(tx: BorrowedFd<'_>, at: i32) -> Result<()> {
    // SAFETY: SO_PEEK_OFF reads one int through the pointer, which lives across the call;
    // `tx` is a valid descriptor. (rustix has no call for this option.)
    let r = unsafe {
        libc::setsockopt(
            tx.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEEK_OFF,
            (&at as *const i32).cast(),
            std::mem::size_of::<i32>() as libc::socklen_t,
        )
    };
    if r != 0 {
        return Err(Error::io("setting a peek offset (SO_PEEK_OFF)", std::io::Error::last_os_error()));
    }
    Ok(())
}

/// The first entry, from the front, for which `want` says yes; every entry looked at and
/// not wanted is closed again. Call under the directory's lock.
pub(crate) fn find(tx: BorrowedFd<'_>, mut want: impl FnMut(&Entry) -> bool) -> Result<Option<Entry>> {
    set_peek_offset(tx, 0)?;
    let found = (|| {
        for _ in 0..MAX_LOOK {
            match peek(tx)? {
                None => return Ok(None),
                Some(Some(e)) if want(&e) => return Ok(Some(e)),
                Some(_) => {}
            }
        }
        Ok(None)
    })();
    // Off again, so that nothing else on the socket ever reads at an offset.
    let _ = set_peek_offset(tx, -1);
    found
}

/// The window of the front entry of `tx`'s receive queue, read in place with `peek`, else
/// taken out: None when the queue is empty, `Some(None)` for a record that is not an entry.
///
/// No descriptor is installed in this process: the read offers no room for one, so the
/// kernel keeps a peeked record's descriptors in the queue and drops its references to
/// those of a record taken out (a description then closes unless someone else holds it),
/// flagging the read `MSG_CTRUNC`, which is how an entry, which carries one, shows here. A
/// record with no descriptor is no entry. (The flag would also be set by credentials or
/// security labels, which nothing here asks the socket for; a peer that asked could only
/// make a record without a descriptor stay in the directory until its window is over.)
fn front_window(tx: BorrowedFd<'_>, peek: bool) -> Result<Option<Option<u64>>> {
    let mut bytes = [0u8; MAX_ENTRY + 1];
    let mut no_room = RecvAncillaryBuffer::default();
    let mut flags = RecvFlags::DONTWAIT;
    if peek {
        flags |= RecvFlags::PEEK;
    }
    let r = match rustix::net::recvmsg(tx, &mut [IoSliceMut::new(&mut bytes)], &mut no_room, flags) {
        Ok(r) => r,
        Err(Errno::AGAIN) => return Ok(None),
        Err(e) => return Err(Error::io("reading the lane's directory (recvmsg)", e)),
    };
    if r.flags.contains(ReturnFlags::TRUNC) || !r.flags.contains(ReturnFlags::CTRUNC) {
        return Ok(Some(None));
    }
    Ok(Some(parse(&bytes[..r.bytes], None).map(|e| e.window)))
}

/// Takes out, from the front, the entries of windows before `open` (over) and those of
/// windows after `last` (which cannot have begun: a peer's), and what is not an entry.
/// Returns how many went. Call under the directory's lock.
pub(crate) fn take_out_over(tx: BorrowedFd<'_>, open: u64, last: u64) -> Result<usize> {
    // Peeks read the front only with the peek offset off. `find` turns it off when it is
    // done, but it may have been left on (a process that died inside `find`, or a reset
    // that failed).
    set_peek_offset(tx, -1)?;
    let mut n = 0;
    for _ in 0..MAX_LOOK {
        match front_window(tx, true)? {
            None => break,
            Some(Some(w)) if w >= open && w <= last => break,
            Some(_) => {
                // Out (the kernel closes what it carried); an entry that arrived meanwhile
                // cannot be the one taken, since entries are only added at the back.
                let _ = front_window(tx, false)?;
                n += 1;
            }
        }
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustix::fs::{flock, FlockOperation};
    use std::os::fd::AsFd;

    #[test]
    fn entries_are_found_in_place_and_taken_out_by_window() {
        let (tx, rx) = crate::channel::socket::pair().unwrap();
        let files: Vec<OwnedFd> = (0..3)
            .map(|_| rustix::fs::memfd_create("dir-test", rustix::fs::MemfdFlags::CLOEXEC).unwrap())
            .collect();
        let ids: Vec<FileId> = files.iter().map(|f| crate::shm::file_id(f.as_fd()).unwrap()).collect();
        for (w, (f, id)) in files.iter().zip(&ids).enumerate() {
            park(rx.as_fd(), f.as_fd(), w as u64, *id, 7, Some("name")).unwrap();
        }
        // A record that is not an entry, from a peer.
        crate::channel::socket::send_record(rx.as_fd(), [b"junk", &[]], &[]).unwrap();
        for _ in 0..2 {
            let e = find(tx.as_fd(), |e| e.id == ids[2]).unwrap().expect("found");
            assert_eq!(e.window, 2);
            assert_eq!(crate::shm::file_id(e.fd.as_ref().unwrap().as_fd()).unwrap(), ids[2]);
        }
        assert!(find(tx.as_fd(), |e| e.id == (0, 0)).unwrap().is_none());
        // Windows 0 and 1 are over: their entries go, window 2's stays (and the junk behind
        // it waits for it).
        assert_eq!(take_out_over(tx.as_fd(), 2, 2).unwrap(), 2);
        assert!(find(tx.as_fd(), |e| e.id == ids[0]).unwrap().is_none());
        assert!(find(tx.as_fd(), |e| e.id == ids[2]).unwrap().is_some());
        assert_eq!(take_out_over(tx.as_fd(), 3, 3).unwrap(), 2);
        assert!(find(tx.as_fd(), |_| true).unwrap().is_none());
        // Normal receives on the other end are unaffected by any of it.
        assert!(matches!(
            crate::channel::socket::try_recv(rx.as_fd()).unwrap(),
            crate::channel::socket::Received::Empty
        ));
    }

    /// A description taken out of the directory is closed: what it held goes. Taking out
    /// reads the front even where a peek offset was left on (a process that died inside
    /// `find`).
    #[test]
    fn what_is_taken_out_is_closed_and_a_stale_peek_offset_changes_nothing() {
        let (tx, rx) = crate::channel::socket::pair().unwrap();
        let file = rustix::fs::memfd_create("dir-test", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
        let id = crate::shm::file_id(file.as_fd()).unwrap();
        let held = crate::shm::reopen(file.as_fd()).unwrap();
        flock(&held, FlockOperation::NonBlockingLockShared).unwrap();
        park(rx.as_fd(), held.as_fd(), 0, id, 1, None).unwrap();
        drop(held);
        let other = crate::shm::reopen(file.as_fd()).unwrap();
        let exclusive = || flock(&other, FlockOperation::NonBlockingLockExclusive).is_ok();
        assert!(!exclusive(), "the parked description holds its lock");
        // Window 1's entry behind it, and a peek offset left past window 0's entry.
        park(rx.as_fd(), file.as_fd(), 1, id, 3, None).unwrap();
        set_peek_offset(tx.as_fd(), ENTRY_HEAD as i32).unwrap();
        assert_eq!(take_out_over(tx.as_fd(), 1, 1).unwrap(), 1);
        assert!(exclusive(), "the description taken out was closed");
        let left = find(tx.as_fd(), |_| true).unwrap().expect("window 1's entry stays");
        assert_eq!((left.window, left.tag), (1, 3));
        assert!(left.fd.is_some());
    }
}
