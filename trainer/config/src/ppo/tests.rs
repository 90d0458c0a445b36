//! Internal invariants of [`PpoConfig`]'s tables; behaviour is tested in `tests/ppo.rs`.

use super::*;
use crate::{hints, tree};

fn schema() -> tree::Schema {
    loader::schema::<PpoConfig>(&loader::defaults_tree::<PpoConfig>())
}

#[test]
fn defaults_resolve_to_the_typed_defaults() {
    assert_eq!(PpoConfig::resolved_default(), PpoConfig::default());
    assert!(PpoConfig::default().changed_keys().is_empty());
}

#[test]
fn every_ppo_synonym_names_a_valid_key() {
    let s = schema();
    for (synonym, key) in hints::PPO_SYNONYMS {
        assert!(s.check_key(key).is_ok(), "{synonym} -> {key}");
        assert!(
            s.check_key(&KEYS.canonical_key(synonym)).is_err(),
            "{synonym} is itself a key"
        );
    }
}

#[test]
fn links_aliases_and_open_keys_name_valid_keys() {
    let s = schema();
    for (key, reference) in LINKS {
        assert!(s.check_key(key).is_ok(), "{key}");
        assert!(reference.contains("${"), "{key}: {reference}");
    }
    for (alias, canonical) in ALIASES {
        assert!(s.check_key(canonical).is_ok(), "{alias} -> {canonical}");
    }
    for open in OPEN_KEYS {
        assert!(s.check_key(&format!("{open}.anything")).is_ok(), "{open}");
    }
}
