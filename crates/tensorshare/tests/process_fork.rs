//! What only the Fork start method does: the worker inherits the parent's memory.

use std::sync::OnceLock;

use tensorshare::{start_processes, DType, StartMethod, Tensor};

tensorshare::enable_test_workers!();

mod common;

/// A tensor made before the fork, reached through a global (torch's test_inherit_tensor
/// passes it as an attribute of the process object, which fork inherits too).
static INHERITED: OnceLock<Tensor> = OnceLock::new();

fn fill_the_inherited_tensor(_rank: usize, _: ()) {
    let mut t = INHERITED.get().expect("inherited from the parent").clone();
    t.fill(3.0f32).unwrap();
}

fn inherit_tensor(_rank: usize, _: StartMethod) {
    let mut t = Tensor::zeros(&[5, 5], DType::F32);
    t.share_memory().unwrap();
    INHERITED.set(t.clone()).unwrap();
    let mut ctx = start_processes(fill_the_inherited_tensor, (), 1, StartMethod::Fork).unwrap();
    assert_eq!(ctx.join(None), Ok(true));
    assert_eq!(t.to_vec::<f32>().unwrap(), vec![3.0; 25]);
}

/// torch's test_inherit_tensor.
#[test]
fn test_inherit_tensor() {
    common::isolated(inherit_tensor, StartMethod::Fork);
}
