//! A channel's receiving end against any record a peer may write, with real descriptors.
//!
//! Input: `[descriptor choice][flags][split: u16 LE][bytes...]`. The choice damages the
//! sample's descriptor table (see `pick_fds`). Flags: bits 0-1 attach a memfd after the
//! table (none, sealed, unsealed, sealed against size changes and future writes only),
//! holding `bytes[split..]` while the record is `bytes[..split]` (with no memfd the record
//! is all of `bytes`); bit 2 moves the table onto a side socket that the record carries
//! instead; bit 3 leaves that socket's writing end open; bit 4 lets go of cached arenas
//! afterwards. The record goes into one end of a pipe that lives as long as the process,
//! and one receive without waiting on the other end must take exactly that record and
//! give a value (checked and read in full) or an error.

#![no_main]

use std::os::fd::AsFd;
use std::sync::OnceLock;
use std::time::Duration;

use libfuzzer_sys::fuzz_target;
use rustix::fs::SealFlags;
use tensorshare::Connection;
use tensorshare_fuzz::{
    after_execution, fixture, memfd_with, pick_fds, send_raw, touch, write_seeds, Sample, SEALED,
};

fn ends() -> &'static (Connection<Sample>, Connection<Sample>) {
    static P: OnceLock<(Connection<Sample>, Connection<Sample>)> = OnceLock::new();
    P.get_or_init(|| tensorshare::pipe::<Sample>().expect("pipe"))
}

fn seeds() -> Vec<Vec<u8>> {
    let m = &fixture().message;
    let n = fixture().fds.len() as u32;
    let len = (m.len() as u64).to_le_bytes();
    let seed =
        |flags: u8, split: u16, frame: &[u8]| [&[0u8, flags][..], &split.to_le_bytes(), frame, m].concat();
    vec![
        seed(0, 0, &[0]),                                                  // inline
        seed(1, 9, &[[1u8].as_slice(), &len].concat()),                    // spilled, sealed memfd
        seed(2, 9, &[[1u8].as_slice(), &len].concat()),                    // spilled, unsealed memfd
        seed(4, 0, &[[2u8].as_slice(), &n.to_le_bytes()].concat()),        // side table
        seed(5, 13, &[[3u8].as_slice(), &len, &n.to_le_bytes()].concat()), // both
        seed(12, 0, &[[2u8].as_slice(), &n.to_le_bytes()].concat()),       // side socket still open
    ]
}

/// One execution. Returns whether a value decoded (None: the record could not be sent).
fn run(data: &[u8]) -> Option<bool> {
    let [sel, flags, s0, s1, bytes @ ..] = data else { return None };
    let (ours, theirs) = ends();
    let memfd = flags & 3;
    let split = usize::from(u16::from_le_bytes([*s0, *s1])) % (bytes.len() + 1);
    let (record, content) = if memfd == 0 { (bytes, &[][..]) } else { bytes.split_at(split) };
    let table = pick_fds(*sel);
    let mut writer = None;
    let mut attached = if flags & 4 != 0 {
        let (w, r) = rustix::net::socketpair(
            rustix::net::AddressFamily::UNIX,
            rustix::net::SocketType::SEQPACKET,
            rustix::net::SocketFlags::CLOEXEC,
            None,
        )
        .expect("socketpair");
        for chunk in table.chunks(253) {
            let b: Vec<_> = chunk.iter().map(AsFd::as_fd).collect();
            send_raw(w.as_fd(), &[2], &b).expect("writing a side table");
        }
        if flags & 8 != 0 {
            writer = Some(w);
        }
        vec![r]
    } else {
        table
    };
    match memfd {
        0 => {}
        1 => attached.push(memfd_with(content, SEALED)),
        2 => attached.push(memfd_with(content, SealFlags::empty())),
        _ => {
            attached.push(memfd_with(content, SealFlags::SHRINK | SealFlags::GROW | SealFlags::FUTURE_WRITE))
        }
    }
    let b: Vec<_> = attached.iter().map(AsFd::as_fd).collect();
    let sent = send_raw(ours.as_fd(), record, &b);
    drop(b);
    drop(attached); // the record holds what it carries
    let decoded = sent.is_ok().then(|| {
        let r = theirs.recv_timeout(Duration::ZERO);
        if let Ok(v) = &r {
            touch(v);
        }
        assert!(!theirs.poll(Duration::ZERO).expect("poll"), "a receive left the record (or another) behind");
        r.is_ok()
    });
    drop(writer);
    if flags & 16 != 0 {
        tensorshare::trim_arenas();
    }
    decoded
}

fuzz_target!(
    init: {
        let seeds = seeds();
        // Sanity: the valid records decode; an unsealed spill and a live side socket do not.
        let got: Vec<_> = seeds.iter().map(|s| run(s)).collect();
        let t = Some(true);
        let f = Some(false);
        assert_eq!(got, [t, t, f, t, t, f], "the seed records' outcomes");
        let (ours, theirs) = ends();
        let f = fixture();
        // And a record with the sample's own descriptors, not duplicates.
        let b: Vec<_> = f.fds.iter().map(AsFd::as_fd).collect();
        send_raw(ours.as_fd(), &[&[0u8][..], &f.message].concat(), &b).expect("send");
        touch(&theirs.recv_timeout(Duration::ZERO).expect("the sample arrives whole"));
        write_seeds("record", &seeds);
    },
    |data: &[u8]| {
        let _ = run(data);
        after_execution();
    }
);
