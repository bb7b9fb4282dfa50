//! torch: test_set_thread_name.

use tensorshare::{get_thread_name, set_thread_name, Error};

#[test]
fn test_set_thread_name() {
    std::thread::spawn(|| {
        let name = "test name";
        set_thread_name(name).unwrap();
        assert_eq!(get_thread_name().unwrap(), name);
        let long = "a name longer than fifteen bytes";
        let err = set_thread_name(long).unwrap_err();
        assert!(matches!(err, Error::Parse(_)));
        assert!(err.to_string().contains("15"), "{err}");
        assert_eq!(get_thread_name().unwrap(), name, "a rejected name changes nothing");
        assert!(set_thread_name("nul\0inside").is_err());
    })
    .join()
    .unwrap();
}
