//! safetensors files: round trips of every dtype (files and buffers), files written by
//! hand, and hostile files, which must be clear errors, never panics.
#![cfg(feature = "safetensors")]

use std::collections::BTreeMap;
use std::path::Path;

mod common;

use common::TempDir;
use tensorshare::{safetensors, DType, Error, Result, Tensor, Weights};

/// A private tensor of `dtype` and `shape` holding a pattern that differs per `seed`.
fn pattern(dtype: DType, shape: &[usize], seed: u8) -> Tensor {
    let n: usize = shape.iter().product();
    let bytes: Vec<u8> = (0..n * dtype.size())
        .map(|i| if dtype == DType::Bool { (i % 3 == 0) as u8 } else { (i as u8).wrapping_mul(37) ^ seed })
        .collect();
    let raw = Tensor::from_vec(bytes, &[n * dtype.size()]).unwrap();
    let strides = contiguous(shape);
    Tensor::from_storage(raw.storage().clone(), dtype, shape, &strides, 0).unwrap()
}

fn contiguous(shape: &[usize]) -> Vec<usize> {
    let mut s = vec![1; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * shape[i + 1];
    }
    s
}

/// One tensor of every dtype, and views with other strides, an empty and a 0-d tensor.
fn zoo() -> Vec<(String, Tensor)> {
    let mut v = Vec::new();
    for (k, d) in DType::ALL.into_iter().enumerate() {
        let t = pattern(d, &[3, 5], k as u8);
        v.push((format!("{d}.t"), t.t().unwrap()));
        v.push((format!("{d}.col"), t.narrow(1, 2, 2).unwrap()));
        v.push((format!("{d}"), t));
    }
    v.push(("empty".into(), pattern(DType::F32, &[0, 4], 0)));
    v.push(("scalar".into(), pattern(DType::I64, &[], 9)));
    v.push(("big".into(), pattern(DType::F16, &[3000, 1000], 3).t().unwrap()));
    v
}

/// Checks that `w` holds exactly `expected` (values, dtypes, shapes), as views of one
/// shared storage, each 64-byte aligned.
fn check_weights(w: &Weights, expected: &[(String, Tensor)]) {
    assert_eq!(w.len(), expected.len());
    assert!(w.storage().is_shared());
    for (name, t) in expected {
        let got = w.get(name).unwrap_or_else(|| panic!("{name} is missing"));
        assert!(got.equal(t), "{name}: {:?} vs {:?}", got, t);
        assert!(got.is_contiguous());
        assert!(got.storage().ptr_eq(w.storage()), "{name} is a view of the one storage");
        let first = got.storage().data_ptr() + got.storage_offset() * got.dtype().size();
        assert_eq!(first % 64, 0, "{name} is 64-byte aligned");
    }
}

#[test]
fn every_dtype_round_trips_through_a_file_and_a_buffer() {
    let dir = TempDir::new("round-trip");
    let tensors = zoo();
    let metadata: BTreeMap<String, String> =
        [("format".to_owned(), "pt".to_owned()), ("note".to_owned(), "ünïcode".to_owned())].into();
    let path = dir.path("zoo.safetensors");
    safetensors::save_with_metadata(&path, tensors.iter().map(|(n, t)| (n, t)), &metadata).unwrap();
    assert_eq!(dir.files(), ["zoo.safetensors"], "no temporary file is left");
    let from_file = safetensors::load(&path).unwrap();
    check_weights(&from_file, &tensors);
    assert_eq!(from_file.metadata(), &metadata);

    let bytes = safetensors::save_bytes(tensors.iter().map(|(n, t)| (n, t)), &metadata).unwrap();
    assert_eq!(bytes, std::fs::read(&path).unwrap(), "the same bytes either way");
    let from_bytes = safetensors::load_bytes(&bytes).unwrap();
    check_weights(&from_bytes, &tensors);
    assert!(!from_bytes.storage().ptr_eq(from_file.storage()), "each load makes its own storage");

    // Loaded weights save again to the same file (file order is kept).
    let again = dir.path("again.safetensors");
    safetensors::save_with_metadata(&again, &from_file, from_file.metadata()).unwrap();
    assert_eq!(std::fs::read(&again).unwrap(), bytes);
}

#[test]
fn file_order_is_by_element_size_then_as_given() {
    let dir = TempDir::new("order");
    let given =
        [("b", DType::U8), ("a", DType::F64), ("c", DType::F16), ("d", DType::I64), ("e", DType::Bool)];
    let tensors: Vec<(&str, Tensor)> = given.iter().map(|&(n, d)| (n, pattern(d, &[3], 1))).collect();
    let path = dir.path("order.safetensors");
    safetensors::save(&path, tensors.iter().map(|(n, t)| (*n, t))).unwrap();
    let w = safetensors::load(&path).unwrap();
    assert_eq!(w.names().collect::<Vec<_>>(), ["a", "d", "c", "b", "e"]);
    // The file's data is aligned to each element size: after the 8-byte-aligned header,
    // 8-byte elements first.
    let bytes = std::fs::read(&path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    assert_eq!(n % 8, 0);
}

/// A file of `json` and `data`, with its length field.
fn raw(json: &str, data: &[u8]) -> Vec<u8> {
    raw_bytes(json.as_bytes(), data)
}

fn raw_bytes(json: &[u8], data: &[u8]) -> Vec<u8> {
    let mut v = (json.len() as u64).to_le_bytes().to_vec();
    v.extend_from_slice(json);
    v.extend_from_slice(data);
    v
}

/// Loads `bytes` from a buffer and from a file; both results.
fn load_both(bytes: &[u8], dir: &TempDir) -> [Result<Weights>; 2] {
    let path = dir.path("input.safetensors");
    std::fs::write(&path, bytes).unwrap();
    let from_file = safetensors::load(&path);
    std::fs::remove_file(&path).unwrap();
    [safetensors::load_bytes(bytes), from_file]
}

#[test]
fn a_file_written_by_hand_is_read_in_offset_order() {
    let dir = TempDir::new("by-hand");
    // The JSON lists the tensors out of order; the data says which comes first.
    let json = r#"{"w":{"dtype":"F32","shape":[2],"data_offsets":[2,10]},"__metadata__":{"k":"v"},"m":{"dtype":"BOOL","shape":[2,1],"data_offsets":[0,2]}}   "#;
    let mut data = vec![1u8, 0];
    data.extend_from_slice(&1.5f32.to_le_bytes());
    data.extend_from_slice(&(-2.0f32).to_le_bytes());
    for w in load_both(&raw(json, &data), &dir) {
        let w = w.unwrap();
        assert_eq!(w.names().collect::<Vec<_>>(), ["m", "w"]);
        assert_eq!(w.get("m").unwrap().to_vec::<bool>().unwrap(), vec![true, false]);
        assert_eq!(w.get("m").unwrap().shape(), &[2, 1]);
        assert_eq!(w.get("w").unwrap().to_vec::<f32>().unwrap(), vec![1.5, -2.0]);
        assert_eq!(w.metadata().get("k").map(String::as_str), Some("v"));
    }
    let empty = raw("{}", &[]);
    for w in load_both(&empty, &dir) {
        let w = w.unwrap();
        assert!(w.is_empty() && w.storage().is_empty());
    }
}

/// Hostile and broken files: each is an error of the expected kind whose message has
/// `needle`, whether read from a file or a buffer.
#[test]
fn hostile_files_are_clear_errors() {
    let dir = TempDir::new("hostile");
    let f32x2 = |offsets: &str| format!(r#"{{"a":{{"dtype":"F32","shape":[2],"data_offsets":{offsets}}}}}"#);
    let mut huge_len = u64::MAX.to_le_bytes().to_vec();
    huge_len.extend_from_slice(b"{}");
    let mut wrapping = (u64::MAX - 3).to_le_bytes().to_vec();
    wrapping.extend_from_slice(&[0; 16]);
    let mut past_end = 100u64.to_le_bytes().to_vec();
    past_end.extend_from_slice(b"{}");
    let two = r#"{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"b":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}}"#;
    let over = r#"{"a":{"dtype":"U8","shape":[4294967296,4294967296],"data_offsets":[0,0]}}"#;
    let over64 = r#"{"a":{"dtype":"I64","shape":[2305843009213693952],"data_offsets":[0,0]}}"#;
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        ("too short", vec![1, 2, 3], "fewer than a header's length field"),
        ("header length past the end", past_end, "claims 100 bytes"),
        ("header length huge", huge_len, "more than the format's"),
        ("header length wraps", wrapping, "claims"),
        ("not JSON", raw("{nope", &[]), "not a valid safetensors file"),
        ("not UTF-8", raw_bytes(b"{\"\xff\":{}}", &[]), "not a valid safetensors file"),
        ("offsets past the end", raw(&f32x2("[0,8]"), &[0; 4]), "not a valid safetensors file"),
        ("offsets reversed", raw(&f32x2("[8,0]"), &[0; 8]), "not a valid safetensors file"),
        ("offsets too short for the shape", raw(&f32x2("[0,4]"), &[0; 4]), "not a valid safetensors file"),
        (
            "offsets overflow",
            raw(&f32x2("[18446744073709551615,7]"), &[0; 8]),
            "not a valid safetensors file",
        ),
        ("overlapping tensors", raw(two, &[0; 6]), "not a valid safetensors file"),
        ("shape overflows", raw(over, &[]), "not a valid safetensors file"),
        ("byte size overflows", raw(over64, &[]), "not a valid safetensors file"),
        ("data left over", raw(&f32x2("[0,8]"), &[0; 9]), "not a valid safetensors file"),
        (
            "a bool that is 2",
            raw(r#"{"m":{"dtype":"BOOL","shape":[3],"data_offsets":[0,3]}}"#, &[0, 1, 2]),
            "element 2 is 2",
        ),
        (
            "a negative dimension",
            raw(r#"{"a":{"dtype":"U8","shape":[-1],"data_offsets":[0,0]}}"#, &[]),
            "not a valid",
        ),
        ("metadata that is no map of strings", raw(r#"{"__metadata__":{"a":1}}"#, &[]), "not a valid"),
    ];
    for (what, bytes, needle) in cases {
        for r in load_both(&bytes, &dir) {
            match r {
                Err(e @ Error::Parse(_)) => assert!(e.to_string().contains(needle), "{what}: {e}"),
                other => panic!("{what}: expected a parse error with {needle:?}, got {other:?}"),
            }
        }
    }
    // The file's name is in the message.
    let path = dir.path("named.safetensors");
    std::fs::write(&path, b"short").unwrap();
    let e = safetensors::load(&path).unwrap_err();
    assert!(e.to_string().contains("named.safetensors"), "{e}");
    assert!(matches!(safetensors::load(dir.path("missing.safetensors")), Err(Error::Io { .. })));
}

#[test]
fn dtypes_without_a_tensorshare_type_are_refused_by_name() {
    let dir = TempDir::new("dtypes");
    for (dtype, size) in [("U16", 2), ("U32", 4), ("U64", 8), ("F8_E4M3", 1), ("F8_E5M2", 1), ("C64", 8)] {
        let json = format!(
            r#"{{"ok":{{"dtype":"U8","shape":[1],"data_offsets":[0,1]}},"odd":{{"dtype":"{dtype}","shape":[2],"data_offsets":[1,{}]}}}}"#,
            1 + 2 * size
        );
        let bytes = raw(&json, &vec![0; 1 + 2 * size]);
        for r in load_both(&bytes, &dir) {
            match r {
                Err(e @ Error::Unsupported(_)) => {
                    let m = e.to_string();
                    assert!(m.contains("\"odd\"") && m.contains(dtype), "{m}");
                }
                other => panic!("{dtype}: expected Unsupported, got {other:?}"),
            }
        }
    }
}

/// Every truncation and many single-byte changes of a valid file: loading gives weights
/// whose tensors can all be read, or an error; never a panic.
#[test]
fn damaged_files_never_panic() {
    let tensors = [("a", pattern(DType::F32, &[2, 3], 1)), ("b", pattern(DType::Bool, &[5], 0))];
    let good = safetensors::save_bytes(tensors.iter().map(|(n, t)| (*n, t)), &BTreeMap::new()).unwrap();
    let check = |bytes: &[u8]| {
        if let Ok(w) = safetensors::load_bytes(bytes) {
            for (_, t) in &w {
                t.to_bytes().unwrap();
            }
        }
    };
    for len in 0..good.len() {
        check(&good[..len]);
    }
    for i in 0..good.len() {
        for v in [0u8, 1, 2, 0xff, b'9', b'"', b'[', b','] {
            let mut bad = good.clone();
            bad[i] = v;
            check(&bad);
        }
    }
    assert!(safetensors::load_bytes(&good).is_ok());
}

#[test]
fn saving_refuses_what_a_file_cannot_hold_and_leaves_nothing_behind() {
    let dir = TempDir::new("save-errors");
    let t = pattern(DType::F32, &[2], 0);
    let path = dir.path("out.safetensors");
    let e = safetensors::save(&path, [("x", &t), ("x", &t)]).unwrap_err();
    assert!(e.to_string().contains("\"x\" names two tensors"), "{e}");
    assert!(safetensors::save(&path, [("__metadata__", &t)]).is_err());
    let meta = Tensor::meta(&[2], DType::F32);
    assert!(matches!(safetensors::save(&path, [("m", &meta)]), Err(Error::Device(_))));
    assert!(matches!(safetensors::save(dir.path("no/such/dir/x"), [("x", &t)]), Err(Error::Io { .. })));
    assert!(dir.files().is_empty(), "{:?}", dir.files());
    // An existing file is replaced whole.
    std::fs::write(&path, b"old").unwrap();
    safetensors::save(&path, [("x", &t)]).unwrap();
    assert!(safetensors::load(&path).unwrap().get("x").unwrap().equal(&t));
    assert!(Path::new(&path).exists() && dir.files() == ["out.safetensors"]);
}

/// A model of many tensors travels as one arena handle: the message carries one
/// descriptor, and decodes to views of one storage.
#[test]
fn the_whole_model_is_one_handle_on_the_wire() {
    let tensors: Vec<(String, Tensor)> =
        (0..40).map(|i| (format!("layer{i}.weight"), pattern(DType::BF16, &[16, 8 + i], i as u8))).collect();
    let bytes = safetensors::save_bytes(tensors.iter().map(|(n, t)| (n, t)), &BTreeMap::new()).unwrap();
    let w = safetensors::load_bytes(&bytes).unwrap();
    let (msg, fds) = tensorshare::raw::encode(&w).unwrap();
    assert_eq!(fds.len(), 1, "one descriptor for the whole model");
    let back: Weights = tensorshare::raw::decode(&msg, fds).unwrap();
    check_weights(&back, &tensors);
    assert_eq!(back.names().collect::<Vec<_>>(), w.names().collect::<Vec<_>>());
}
