//! Every layer's fork guard is registered as the library loads, before anything uses it: a
//! guard registered on a static's first use leaves a moment in which a fork from another
//! thread finds the static half made or its lock held with no guard to wait on, and the
//! child waits for good. Alone in its binary, so that nothing has used the library before
//! the check.

#[test]
fn every_layer_is_guarded_before_first_use() {
    assert_eq!(tensorshare::raw::layers_without_fork_guard(), Vec::<String>::new());
}
