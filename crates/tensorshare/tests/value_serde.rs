//! `Value`, `to_value` and `from_value`: Rust values in the shape a Python process sees,
//! with tensors kept as tensors (the same storage, no copy), and bad values refused with a
//! clear error.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use tensorshare::value::{from_value, to_value, MAX_DEPTH};
use tensorshare::{DType, Error, Message, Tensor, Value};

#[derive(Serialize, Deserialize, Debug)]
enum Split {
    Train,
    Eval { every: u32 },
    Custom(String),
}

#[derive(Serialize, Deserialize, Debug)]
struct Batch {
    images: Tensor,
    labels: Tensor,
    ids: Vec<u64>,
    scale: f32,
    note: Option<String>,
    split: Split,
    extra: Value,
    shapes: BTreeMap<String, (usize, usize)>,
}

fn batch() -> Batch {
    let mut images = Tensor::zeros(&[2, 3, 4], DType::F32);
    images.fill(0.5f32).unwrap();
    Batch {
        images,
        labels: Tensor::from_vec(vec![1i64, 7], &[2]).unwrap(),
        ids: vec![10, 11],
        scale: 0.25,
        note: None,
        split: Split::Eval { every: 3 },
        extra: Value::List(vec![Value::Int(1), Value::Str("x".into())]),
        shapes: BTreeMap::from([("image".to_string(), (3, 4))]),
    }
}

#[test]
fn a_struct_becomes_a_dict_keyed_by_its_fields_with_tensors_unchanged() {
    let b = batch();
    let v = to_value(&b).unwrap();
    let images = v.get("images").and_then(Value::as_tensor).unwrap();
    assert!(images.storage().ptr_eq(b.images.storage()), "the tensor is the same storage, not a copy");
    assert_eq!(v.get("ids").and_then(Value::as_slice).unwrap().len(), 2);
    assert_eq!(v.get("scale").and_then(Value::as_f64), Some(0.25));
    assert!(matches!(v.get("note"), Some(Value::None)));
    // an enum's struct variant: a dict of one item, its name to its fields
    let split = v.get("split").unwrap();
    assert_eq!(split.get("Eval").and_then(|e| e.get("every")).and_then(Value::as_i64), Some(3));
    // a Value field stays what it is, not an enum wrapped in a dict
    assert!(matches!(v.get("extra"), Some(Value::List(items)) if items.len() == 2));
    assert!(matches!(v.get("shapes").and_then(|s| s.get("image")), Some(Value::Tuple(t)) if t.len() == 2));
}

#[test]
fn from_value_reads_back_what_to_value_wrote_and_keeps_the_storage() {
    let b = batch();
    let back: Batch = from_value(to_value(&b).unwrap()).unwrap();
    assert!(back.images.storage().ptr_eq(b.images.storage()));
    assert_eq!(back.labels.to_vec::<i64>().unwrap(), vec![1, 7]);
    assert_eq!(back.ids, vec![10, 11]);
    assert!(matches!(back.split, Split::Eval { every: 3 }));
    assert!(matches!(back.extra, Value::List(ref items) if items.len() == 2));
    for s in [Split::Train, Split::Custom("c".into())] {
        let again: Split = from_value(to_value(&s).unwrap()).unwrap();
        assert_eq!(format!("{again:?}"), format!("{s:?}"));
    }
}

#[test]
fn a_value_through_the_wire_keeps_its_shape_and_aliases_its_tensors() {
    let b = batch();
    let v = to_value(&b).unwrap();
    let got: Value = Message::encode(&v).unwrap().decode().unwrap();
    let back: Batch = from_value(got).unwrap();
    assert_eq!(back.images.storage().data_ptr(), b.images.storage().data_ptr());
    assert_eq!(back.scale, 0.25);
}

#[test]
fn a_mismatch_says_what_was_expected_and_what_came() {
    let v = Value::dict([("images", Value::Int(3))]);
    let e = from_value::<Batch>(v).unwrap_err();
    assert!(matches!(e, Error::InvalidMessage(_)), "{e}");
    assert!(e.to_string().contains("an int where a tensor was expected"), "{e}");
    let e = from_value::<Vec<u8>>(Value::Str("no".into())).unwrap_err();
    assert!(e.to_string().contains("str") || e.to_string().contains("string"), "{e}");
    let e = from_value::<Split>(Value::Int(1)).unwrap_err();
    assert!(e.to_string().contains("where an enum"), "{e}");
}

#[test]
fn integers_beyond_64_bits_are_refused() {
    let e = to_value(&u64::MAX).unwrap_err();
    assert!(matches!(e, Error::Serialize(_)) && e.to_string().contains("does not fit in 64 bits"), "{e}");
    assert!(matches!(to_value(&(i64::MAX as u64)).unwrap(), Value::Int(i64::MAX)));
}

#[test]
fn a_value_nested_deeper_than_the_limit_is_a_bad_message_not_a_stack_overflow() {
    // Built and encoded on a thread with room to spare; the receiver refuses it at the limit.
    std::thread::Builder::new()
        .stack_size(64 << 20)
        .spawn(|| {
            let nest = |depth: usize| {
                let mut v = Value::Int(0);
                for _ in 0..depth {
                    v = Value::List(vec![v]);
                }
                v
            };
            let ok: Value = Message::encode(&nest(MAX_DEPTH - 1)).unwrap().decode().unwrap();
            drop(ok);
            let e = Message::encode(&nest(MAX_DEPTH + 10)).unwrap().decode::<Value>().unwrap_err();
            assert!(matches!(e, Error::InvalidMessage(_)), "{e}");
            assert!(e.to_string().contains(&format!("nested deeper than {MAX_DEPTH} levels")), "{e}");
        })
        .unwrap()
        .join()
        .unwrap();
}
