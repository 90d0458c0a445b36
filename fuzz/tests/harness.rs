//! The harness finds what it promises to find: panics, hangs, accepted malformed inputs, empty error messages.

use ferl_fuzz::{Expect, Target};
use proptest::collection::vec;
use proptest::prelude::*;

fn bytes() -> impl Strategy<Value = Vec<u8>> {
    vec(any::<u8>(), 0..64)
}

#[test]
#[should_panic(expected = "panicked: found the byte")]
fn a_panic_is_found() {
    Target::new("harness-panic", |b: &[u8]| {
        assert!(!b.contains(&0x42), "found the byte");
        Err("no".into())
    })
    .generate("bytes", bytes(), Expect::Any)
    .run();
}

#[test]
#[should_panic(expected = "(hang)")]
fn a_hang_is_found() {
    Target::new("harness-hang", |b: &[u8]| {
        while b.len() > 3 {
            std::thread::sleep(std::time::Duration::from_secs(1));
        }
        Err("short".into())
    })
    .generate("bytes", bytes(), Expect::Any)
    .run();
}

#[test]
#[should_panic(expected = "a malformed input was accepted")]
fn an_accepted_malformed_input_is_found() {
    Target::new("harness-accepts", |_: &[u8]| Ok(()))
        .generate("malformed", bytes(), Expect::Refused)
        .run();
}

#[test]
#[should_panic(expected = "refused with an empty error message")]
fn an_empty_error_message_is_found() {
    Target::new("harness-empty-error", |_: &[u8]| Err(String::new()))
        .generate("bytes", bytes(), Expect::Any)
        .run();
}

#[test]
#[should_panic(expected = "panicked: mutated")]
fn mutations_reach_what_the_strategies_do_not() {
    // The strategy only makes zeros; a mutation must produce another byte.
    Target::new("harness-mutation", |b: &[u8]| {
        assert!(b.iter().all(|&x| x == 0), "mutated");
        Ok(())
    })
    .generate("zeros", vec(Just(0u8), 1..16), Expect::Any)
    .run();
}
