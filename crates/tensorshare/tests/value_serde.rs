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

/// A mismatch deep in a value says where it is: dict keys and list positions from the top,
/// a key that is not a string in brackets. (It said only what was expected and what came,
/// which in a batch of many samples does not say which one.)
#[test]
fn a_mismatch_says_where_in_the_value_it_is() {
    #[derive(Deserialize, Debug)]
    struct Sample {
        #[allow(dead_code)]
        labels: Vec<i64>,
    }
    #[derive(Deserialize, Debug)]
    struct Request {
        #[allow(dead_code)]
        samples: Vec<Sample>,
    }
    let sample = |labels: Vec<Value>| Value::dict([("labels", Value::List(labels))]);
    let v = Value::dict([(
        "samples",
        Value::List(vec![
            sample(vec![Value::Int(1)]),
            sample(vec![Value::Int(2), Value::Str("three".into())]),
        ]),
    )]);
    let e = from_value::<Request>(v).unwrap_err();
    assert!(matches!(e, Error::InvalidMessage(_)), "{e}");
    assert!(e.to_string().contains("at samples[1].labels[1]: "), "{e}");
    assert!(
        e.to_string().ends_with(r#"at samples[1].labels[1]: invalid type: string "three", expected i64"#),
        "{e}"
    );
    let e =
        from_value::<BTreeMap<i64, String>>(Value::Dict(vec![(Value::Int(5), Value::Int(3))])).unwrap_err();
    assert!(e.to_string().contains("at [5]: "), "{e}");
    // At the top there is no path to give.
    let e = from_value::<i64>(Value::Str("x".into())).unwrap_err();
    assert!(!e.to_string().contains("at "), "{e}");
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
    // What Python pickles (an int of 2**63, which a u64 would hold) says what it may be.
    let e = from_value::<u64>(Value::Object { pickle: vec![], tensors: vec![] }).unwrap_err();
    assert!(e.to_string().contains("a Python int outside i64 and u64"), "{e}");
}

#[test]
fn a_u64_beyond_i64_travels_as_a_uint_and_wider_integers_are_refused() {
    // A Rust u64 (a hash, a seed) over i64's range is a UInt, through the wire and back.
    #[derive(Serialize, Deserialize, PartialEq, Debug)]
    struct Seeds {
        hashes: Vec<u64>,
        wide: u128,
        small: i128,
    }
    let seeds =
        Seeds { hashes: vec![0, i64::MAX as u64, 1 << 63, u64::MAX], wide: u128::from(u64::MAX), small: -5 };
    let v = to_value(&seeds).unwrap();
    let hashes = v.get("hashes").and_then(Value::as_slice).unwrap();
    assert!(matches!(hashes[1], Value::Int(i64::MAX)), "{hashes:?}");
    assert!(matches!(hashes[2], Value::UInt(u) if u == 1 << 63), "{hashes:?}");
    assert!(matches!(v.get("wide"), Some(Value::UInt(u64::MAX))), "{v:?}");
    assert!(matches!(v.get("small"), Some(Value::Int(-5))), "{v:?}");
    let got: Value = Message::encode(&v).unwrap().decode().unwrap();
    assert_eq!(from_value::<Seeds>(got).unwrap(), seeds);
    assert_eq!(Value::UInt(u64::MAX).as_u64(), Some(u64::MAX));
    assert_eq!(Value::UInt(u64::MAX).as_i64(), None);
    assert_eq!(Value::Int(-1).as_u64(), None);
    // A UInt that an Int would have held (a peer that writes it so) is that number.
    assert_eq!(from_value::<i8>(Value::UInt(7)).unwrap(), 7);
    // Out of range of what reads it: an error, not a wrapped number.
    let e = from_value::<i64>(Value::UInt(u64::MAX)).unwrap_err();
    assert!(e.to_string().contains("18446744073709551615"), "{e}");
    for e in [to_value(&u128::MAX).unwrap_err(), to_value(&i128::MIN).unwrap_err()] {
        assert!(
            matches!(e, Error::Serialize(_)) && e.to_string().contains("outside the range of i64 and of u64"),
            "{e}"
        );
    }
}

/// The shape of `Value` on the wire up to its `List`, with no limit on nesting: what a
/// peer that ignores the limit would send.
#[derive(Serialize)]
#[allow(dead_code)]
enum Unlimited {
    None,
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(String),
    Bytes(Vec<u8>),
    List(Vec<Unlimited>),
}

#[derive(Serialize)]
struct Node {
    next: Option<Box<Node>>,
}

#[test]
fn a_value_nested_deeper_than_the_limit_is_refused_by_sender_and_receiver_not_a_stack_overflow() {
    // Built on a thread with room to spare for building and dropping them; the sender
    // refuses at the limit, before it recurses further, and so does the receiver.
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
            let deepest = nest(MAX_DEPTH - 1); // MAX_DEPTH levels in all
            let ok: Value = Message::encode(&deepest).unwrap().decode().unwrap();
            drop(ok);
            assert!(to_value(&deepest).is_ok());
            // The sender: it used to send these, which every receiver refused, and a value
            // nested a few thousand levels deep overflowed its stack.
            for depth in [MAX_DEPTH, 100_000] {
                let deep = nest(depth);
                let e = Message::encode(&deep).unwrap_err();
                assert!(e.to_string().contains(&format!("nested deeper than {MAX_DEPTH} levels")), "{e}");
            }
            let mut list = Node { next: None };
            for _ in 0..100_000 {
                list = Node { next: Some(Box::new(list)) };
            }
            let e = to_value(&list).unwrap_err();
            assert!(matches!(e, Error::Serialize(_)), "{e}");
            assert!(e.to_string().contains(&format!("nested deeper than {MAX_DEPTH} levels")), "{e}");
            // MAX_DEPTH levels: MAX_DEPTH - 1 dicts, and the last one's `None`.
            let mut short = Node { next: None };
            for _ in 0..MAX_DEPTH - 2 {
                short = Node { next: Some(Box::new(short)) };
            }
            let v = to_value(&short).unwrap();
            let _: Value = Message::encode(&v).unwrap().decode().unwrap();
            let e = to_value(&Node { next: Some(Box::new(short)) }).unwrap_err();
            assert!(e.to_string().contains(&format!("nested deeper than {MAX_DEPTH} levels")), "{e}");
            // The receiver, from a peer that ignores the limit.
            let mut u = Unlimited::Int(0);
            for _ in 0..MAX_DEPTH + 10 {
                u = Unlimited::List(vec![u]);
            }
            let e = Message::encode(&u).unwrap().decode::<Value>().unwrap_err();
            assert!(matches!(e, Error::InvalidMessage(_)), "{e}");
            assert!(e.to_string().contains(&format!("nested deeper than {MAX_DEPTH} levels")), "{e}");
        })
        .unwrap()
        .join()
        .unwrap();
}

#[derive(Serialize, Deserialize, Debug)]
#[serde(tag = "type")]
enum Tagged {
    Batch { images: Tensor, index: i64 },
    Any { v: Value },
    Reply { to: tensorshare::Queue<Value> },
}

#[derive(Serialize, Deserialize, Debug)]
#[serde(untagged)]
enum Untagged {
    Named { images: Tensor, name: String },
    Numbered { images: Tensor, number: i64 },
}

#[derive(Serialize, Deserialize, Debug)]
struct Header {
    index: i64,
    labels: Tensor,
}

#[derive(Serialize, Deserialize, Debug)]
struct Flat {
    #[serde(flatten)]
    header: Header,
    images: Tensor,
}

#[test]
fn tensors_queues_and_values_are_read_inside_tagged_and_untagged_enums_and_flattened_structs() {
    // serde reads these shapes from a buffer it fills through `deserialize_any`; a tensor
    // there was "a tensor where any value was expected".
    let images = Tensor::from_vec(vec![1.0f32, 2.0], &[2]).unwrap();
    let same = |t: &Tensor| t.storage().ptr_eq(images.storage());

    // As a Python process sends it: {"type": "Batch", "images": tensor, "index": 3}.
    let sent = Value::dict([
        ("type", Value::from("Batch")),
        ("images", Value::Tensor(images.clone())),
        ("index", Value::Int(3)),
    ]);
    match from_value::<Tagged>(sent).unwrap() {
        Tagged::Batch { images: t, index: 3 } => assert!(same(&t), "the tensor is the one sent, not a copy"),
        other => panic!("{other:?}"),
    }
    // A Value field takes a plain value as it is, and a tensor as a tensor.
    let any = |v: Value| from_value::<Tagged>(Value::dict([("type", Value::from("Any")), ("v", v)])).unwrap();
    assert!(matches!(any(Value::Int(3)), Tagged::Any { v: Value::Int(3) }));
    match any(Value::dict([("a", Value::List(vec![Value::Tensor(images.clone()), Value::None]))])) {
        Tagged::Any { v } => {
            let a = v.get("a").and_then(Value::as_slice).unwrap();
            assert!(same(a[0].as_tensor().unwrap()) && matches!(a[1], Value::None), "{a:?}");
        }
        other => panic!("{other:?}"),
    }
    // A queue, written by to_value and read back.
    let q = tensorshare::Queue::<Value>::new().unwrap();
    q.put(Value::Int(9)).map_err(|e| e.into_parts().1).unwrap();
    match from_value::<Tagged>(to_value(&Tagged::Reply { to: q.clone() }).unwrap()).unwrap() {
        Tagged::Reply { to } => assert!(matches!(to.get().unwrap(), Value::Int(9)), "another queue"),
        other => panic!("{other:?}"),
    }

    // An untagged enum tries its variants on one buffer: the tensor is read again by the
    // second after the first failed.
    let sent = Value::dict([("images", Value::Tensor(images.clone())), ("number", Value::Int(5))]);
    match from_value::<Untagged>(sent).unwrap() {
        Untagged::Numbered { images: t, number: 5 } => assert!(same(&t)),
        other => panic!("{other:?}"),
    }
    let back: Untagged =
        from_value(to_value(&Untagged::Named { images: images.clone(), name: "n".into() }).unwrap()).unwrap();
    assert!(
        matches!(back, Untagged::Named { ref images, ref name } if same(images) && name == "n"),
        "{back:?}"
    );

    // A flattened struct.
    let labels = Tensor::from_vec(vec![7i64], &[1]).unwrap();
    let back: Flat = from_value(
        to_value(&Flat { header: Header { index: 1, labels: labels.clone() }, images: images.clone() })
            .unwrap(),
    )
    .unwrap();
    assert!(
        same(&back.images) && back.header.labels.storage().ptr_eq(labels.storage()) && back.header.index == 1
    );

    // A tensor where a plain field is read through the buffer is refused, naming it.
    let e = from_value::<Tagged>(Value::dict([
        ("type", Value::from("Batch")),
        ("images", Value::Int(1)),
        ("index", Value::Int(3)),
    ]))
    .unwrap_err();
    assert!(e.to_string().contains("an int where a tensor was expected"), "{e}");
    let e = from_value::<Tagged>(Value::dict([
        ("type", Value::from("Batch")),
        ("images", Value::Tensor(images.clone())),
        ("index", Value::Tensor(images.clone())),
    ]))
    .unwrap_err();
    assert!(
        e.to_string()
            .contains("a tensor, an array, a queue, a pickled object or a pipe's end where i64 was expected"),
        "{e}"
    );
    // A buffered Value field keeps what serde's buffer keeps: a tuple arrives as a list.
    assert!(
        matches!(any(Value::Tuple(vec![Value::Int(1)])), Tagged::Any { v: Value::List(l) } if l.len() == 1)
    );
}

#[test]
fn a_received_map_shaped_like_a_buffered_tensor_is_no_tensor() {
    // Inside serde's buffer a tensor is a map of one item, a key of the conversion's own
    // (with a random part) to its place: a peer's map of the token to a number is a map.
    let images = Tensor::from_vec(vec![1.0f32], &[1]).unwrap();
    for forged in ["$tensorshare::Value", "$tensorshare::Value#0000000000000000"] {
        let v = Value::dict([
            ("type", Value::from("Any")),
            ("v", Value::dict([(forged, Value::Int(0))])),
            ("w", Value::Tensor(images.clone())),
        ]);
        match from_value::<Tagged>(v).unwrap() {
            Tagged::Any { v } => assert_eq!(v.get(forged).and_then(Value::as_i64), Some(0), "{v:?}"),
            other => panic!("{other:?}"),
        }
    }
}
