//! What the ranks bring to a collective, and whether they agree.
//!
//! A collective's signature names the collective, its operation or root, and the dtype and
//! shape of the tensor. Each rank posts its signature (and, if it cannot take part, why) in
//! its record on the board; after a barrier every rank of the node reads all records and
//! reaches the same verdict. With several nodes, each leader sends its node's verdict to
//! the other leaders (MPI) and posts the job's verdict for its node.

use super::board::RECORD_WORDS;
use super::reduce::ReduceOp;
use super::DistError;
use crate::DType;

/// Words of a signature.
pub(super) const SIG: usize = 16;
/// Dimensions a signature lists (more are in its hash only).
const DIMS: usize = 8;

/// A signature: `[kind, op or root, dtype + 1 (0: none), ndim, numel, shape hash, dims..]`.
pub(super) type Sig = [u64; SIG];

/// A collective.
#[derive(Clone, Copy, Debug)]
pub(super) enum Kind {
    AllReduce(ReduceOp),
    Broadcast(usize),
    AllGather,
    Barrier,
}

/// The signature of `kind` on a tensor of `dtype` and `shape` (none for a barrier).
pub(super) fn signature(kind: Kind, tensor: Option<(DType, &[usize])>) -> Sig {
    let mut s = [0u64; SIG];
    (s[0], s[1]) = match kind {
        Kind::AllReduce(op) => (1, op.code()),
        Kind::Broadcast(root) => (2, root as u64),
        Kind::AllGather => (3, 0),
        Kind::Barrier => (4, 0),
    };
    if let Some((dtype, shape)) = tensor {
        s[2] = DType::ALL.iter().position(|&d| d == dtype).map_or(0, |i| i as u64 + 1);
        s[3] = shape.len() as u64;
        s[4] = shape.iter().fold(1u64, |n, &d| n.wrapping_mul(d as u64));
        // FNV-1a over the dimensions: shapes that differ past DIMS still differ.
        s[5] =
            shape.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &d| (h ^ d as u64).wrapping_mul(0x100_0000_01b3));
        for (w, &d) in s[6..6 + DIMS].iter_mut().zip(shape) {
            *w = d as u64;
        }
    }
    s
}

/// The collective a signature names, in words: `all_reduce (sum)`.
pub(super) fn kind_name(s: &Sig) -> String {
    match s[0] {
        1 => format!("all_reduce ({})", ReduceOp::from_code(s[1]).map_or("an unknown op", ReduceOp::name)),
        2 => format!("broadcast from rank {}", s[1]),
        3 => "all_gather".into(),
        4 => "barrier".into(),
        k => format!("an unknown collective ({k})"),
    }
}

/// A signature in words: `all_reduce (sum) of an f32 tensor of shape [4, 4]`.
pub(super) fn describe(s: &Sig) -> String {
    let mut out = kind_name(s);
    if let Some(dtype) = s[2].checked_sub(1).and_then(|i| DType::ALL.get(i as usize)) {
        let shown = (s[3] as usize).min(DIMS);
        let mut dims: Vec<String> = s[6..6 + shown].iter().map(u64::to_string).collect();
        if s[3] as usize > DIMS {
            dims.push("...".into());
        }
        out += &format!(" of a {dtype} tensor of shape [{}]", dims.join(", "));
    }
    out
}

/// Where a text starts in a record, and in a verdict.
const RECORD_TEXT: usize = SIG + 2;
const VERDICT_TEXT: usize = 3 + 2 * SIG + 1;

fn put_text(words: &mut [u64; RECORD_WORDS], at: usize, text: &str) {
    let room = (RECORD_WORDS - at) * 8;
    let mut end = text.len().min(room);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    words[at - 1] = end as u64;
    let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut words[at..]);
    bytes[..end].copy_from_slice(&text.as_bytes()[..end]);
}

fn get_text(words: &[u64; RECORD_WORDS], at: usize) -> String {
    let bytes: &[u8] = bytemuck::cast_slice(&words[at..]);
    let len = (words[at - 1] as usize).min(bytes.len());
    String::from_utf8_lossy(&bytes[..len]).into_owned()
}

/// A rank's record: its signature, and why it cannot take part, if it cannot.
pub(super) fn record(sig: &Sig, refusal: Option<&str>) -> [u64; RECORD_WORDS] {
    let mut w = [0u64; RECORD_WORDS];
    w[..SIG].copy_from_slice(sig);
    if let Some(reason) = refusal {
        w[SIG] = 1;
        put_text(&mut w, RECORD_TEXT, reason);
    }
    w
}

/// Whether the ranks agree.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Verdict {
    /// They do; `rank` (the first) called `sig`.
    Agreed { rank: usize, sig: Sig },
    /// `rank` cannot take part.
    Refused { rank: usize, reason: String },
    /// `rank` called `theirs`, `other` called `ours`.
    Mismatch { rank: usize, theirs: Sig, other: usize, ours: Sig },
}

impl Verdict {
    /// The verdict on `records` (by local rank), posted by `ranks`.
    pub(super) fn of_records(records: &[[u64; RECORD_WORDS]], ranks: &[usize]) -> Verdict {
        let sig = |w: &[u64; RECORD_WORDS]| -> Sig { w[..SIG].try_into().unwrap_or([0; SIG]) };
        for (w, &rank) in records.iter().zip(ranks) {
            if w[SIG] != 0 {
                return Verdict::Refused { rank, reason: get_text(w, RECORD_TEXT) };
            }
        }
        let (Some(first), Some(&rank0)) = (records.first(), ranks.first()) else {
            return Verdict::Refused { rank: 0, reason: "no ranks".into() };
        };
        for (w, &rank) in records.iter().zip(ranks).skip(1) {
            if sig(w) != sig(first) {
                return Verdict::Mismatch { rank, theirs: sig(w), other: rank0, ours: sig(first) };
            }
        }
        Verdict::Agreed { rank: rank0, sig: sig(first) }
    }

    /// The job's verdict from the verdicts of its nodes, in node order.
    pub(super) fn of_nodes(nodes: &[Verdict]) -> Verdict {
        if let Some(v) = nodes.iter().find(|v| !matches!(v, Verdict::Agreed { .. })) {
            return v.clone();
        }
        let Some(Verdict::Agreed { rank: rank0, sig: ours }) = nodes.first() else {
            return Verdict::Refused { rank: 0, reason: "no nodes".into() };
        };
        for v in &nodes[1..] {
            if let Verdict::Agreed { rank, sig } = v {
                if sig != ours {
                    return Verdict::Mismatch { rank: *rank, theirs: *sig, other: *rank0, ours: *ours };
                }
            }
        }
        nodes[0].clone()
    }

    /// The verdict as board words.
    pub(super) fn to_words(&self) -> [u64; RECORD_WORDS] {
        let mut w = [0u64; RECORD_WORDS];
        match self {
            Verdict::Agreed { rank, sig } => {
                (w[0], w[1]) = (0, *rank as u64);
                w[3..3 + SIG].copy_from_slice(sig);
            }
            Verdict::Refused { rank, reason } => {
                (w[0], w[1]) = (1, *rank as u64);
                put_text(&mut w, VERDICT_TEXT, reason);
            }
            Verdict::Mismatch { rank, theirs, other, ours } => {
                (w[0], w[1], w[2]) = (2, *rank as u64, *other as u64);
                w[3..3 + SIG].copy_from_slice(theirs);
                w[3 + SIG..3 + 2 * SIG].copy_from_slice(ours);
            }
        }
        w
    }

    /// Board words back into a verdict.
    pub(super) fn from_words(w: &[u64; RECORD_WORDS]) -> Verdict {
        let sig = |at: usize| -> Sig { w[at..at + SIG].try_into().unwrap_or([0; SIG]) };
        let rank = |k: usize| usize::try_from(w[k]).unwrap_or(usize::MAX);
        match w[0] {
            0 => Verdict::Agreed { rank: rank(1), sig: sig(3) },
            1 => Verdict::Refused { rank: rank(1), reason: get_text(w, VERDICT_TEXT) },
            _ => Verdict::Mismatch { rank: rank(1), theirs: sig(3), other: rank(2), ours: sig(3 + SIG) },
        }
    }

    /// Ok when the ranks agree, else the error every rank returns. `mine`: this rank's
    /// signature.
    pub(super) fn into_result(self, mine: &Sig) -> Result<(), DistError> {
        match self {
            Verdict::Agreed { .. } => Ok(()),
            Verdict::Refused { rank, reason } => {
                Err(DistError::Refused { op: kind_name(mine), rank, reason })
            }
            Verdict::Mismatch { rank, theirs, other, ours } => Err(DistError::Mismatch {
                op: kind_name(mine),
                rank,
                theirs: describe(&theirs),
                other,
                ours: describe(&ours),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verdicts_name_the_rank_that_differs_and_survive_the_board() {
        let f32s = signature(Kind::AllReduce(ReduceOp::Sum), Some((DType::F32, &[4, 4])));
        let f64s = signature(Kind::AllReduce(ReduceOp::Sum), Some((DType::F64, &[4, 4])));
        let recs = [record(&f32s, None), record(&f32s, None), record(&f64s, None)];
        let v = Verdict::of_records(&recs, &[4, 5, 6]);
        assert_eq!(v, Verdict::Mismatch { rank: 6, theirs: f64s, other: 4, ours: f32s });
        assert_eq!(Verdict::from_words(&v.to_words()), v);
        let e = v.into_result(&f32s).unwrap_err().to_string();
        assert!(e.contains("rank 6 called all_reduce (sum) of a float64 tensor of shape [4, 4]"), "{e}");
        let refused = [record(&f32s, None), record(&f32s, Some("a tensor on the meta device \u{e9}"))];
        let v = Verdict::of_records(&refused, &[0, 1]);
        assert_eq!(Verdict::from_words(&v.to_words()), v);
        assert!(v.into_result(&f32s).unwrap_err().to_string().contains("rank 1 could not take part"));
    }

    #[test]
    fn nodes_that_agree_with_different_signatures_mismatch() {
        let a = signature(Kind::Broadcast(0), Some((DType::I64, &[3])));
        let b = signature(Kind::Broadcast(1), Some((DType::I64, &[3])));
        let v =
            Verdict::of_nodes(&[Verdict::Agreed { rank: 0, sig: a }, Verdict::Agreed { rank: 2, sig: b }]);
        assert!(matches!(v, Verdict::Mismatch { rank: 2, other: 0, .. }), "{v:?}");
        let long: Vec<usize> = (1..20).collect();
        let s = describe(&signature(Kind::AllGather, Some((DType::U8, &long))));
        assert!(s.ends_with("7, 8, ...]"), "{s}");
    }

    #[test]
    fn long_reasons_are_cut_at_a_character() {
        let sig = signature(Kind::Barrier, None);
        let reason = "\u{e9}".repeat(1000);
        let v = Verdict::of_records(&[record(&sig, Some(&reason))], &[0]);
        let Verdict::Refused { reason: got, .. } = Verdict::from_words(&v.to_words()) else { panic!() };
        assert!(!got.is_empty() && reason.starts_with(&got));
    }
}
