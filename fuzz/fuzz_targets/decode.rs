//! The bare decoder against any message bytes, with real descriptors.
//!
//! Input: `[descriptor choice][flags][message bytes...]`. The choice damages the sample's
//! descriptor table (see `pick_fds`); flag bit 0 lets go of the arenas the receive cache
//! keeps mapped afterwards, so that the next message opens and checks them anew. A value
//! that decodes is checked and read in full (see `touch`).

#![no_main]

use libfuzzer_sys::fuzz_target;
use tensorshare_fuzz::{after_execution, fixture, pick_fds, touch, write_seeds, Sample};

fuzz_target!(
    init: {
        let f = fixture();
        // Sanity: the untouched message decodes.
        let v: Sample = tensorshare::raw::decode(&f.message, pick_fds(0)).expect("the sample decodes");
        touch(&v);
        let seed = |flags: u8| [&[0u8, flags][..], &f.message].concat();
        write_seeds("decode", &[seed(0), seed(1)]);
    },
    |data: &[u8]| {
        let [sel, flags, message @ ..] = data else { return };
        if let Ok(v) = tensorshare::raw::decode::<Sample>(message, pick_fds(*sel)) {
            touch(&v);
        }
        if flags & 1 != 0 {
            tensorshare::trim_arenas();
        }
        after_execution();
    }
);
