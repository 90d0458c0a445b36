//! The untyped config tree (a YAML value) that files and overrides are applied to before it becomes an
//! [`SftConfig`](crate::SftConfig): dotted-key access, the schema of valid keys with nearest-key suggestions, and the
//! old spellings accepted for verl's keys.

use anyhow::{bail, Result};
use serde_yaml::{Mapping, Value};

/// Old or alternative spellings accepted for verl's keys: `(alias, canonical)`. An alias may also be a prefix: it is
/// matched on whole segments (`trainer.save_interval.x` is rewritten, `trainer.save_intervals` is not).
/// `model.use_remove_padding` and `model.ulysses_sequence_parallel_size` (where newer verl scripts put them) mean
/// verl's top-level keys.
pub const ALIASES: &[(&str, &str)] = &[
    ("optim.warmup_steps_ratio", "optim.lr_warmup_steps_ratio"),
    ("trainer.save_interval", "trainer.save_freq"),
    ("optim.lr_scheduler_type", "optim.lr_scheduler"),
    ("optim.warmup_style", "optim.lr_scheduler"),
    ("model.use_remove_padding", "use_remove_padding"),
    (
        "model.ulysses_sequence_parallel_size",
        "ulysses_sequence_parallel_size",
    ),
];

/// Keys whose value is a free-form mapping: any key below them is accepted and passed on as-is.
pub const OPEN_KEYS: &[&str] = &[
    "data.apply_chat_template_kwargs",
    "data.plugin_options",
    "optim.override_optimizer_config",
];

/// The key tables of one config type: its accepted old spellings, its open keys and its synonyms for hints.
#[derive(Debug, Clone, Copy)]
pub struct KeyTables {
    /// `(alias, canonical)` spellings, as [`ALIASES`].
    pub aliases: &'static [(&'static str, &'static str)],
    /// Keys whose value is a free-form mapping, as [`OPEN_KEYS`].
    pub open_keys: &'static [&'static str],
    /// `(synonym, canonical key)` hints, as [`crate::hints::SYNONYMS`].
    pub synonyms: &'static [(&'static str, &'static str)],
}

/// [`SftConfig`](crate::SftConfig)'s tables: [`ALIASES`], [`OPEN_KEYS`] and [`crate::hints::SYNONYMS`].
pub const SFT_KEYS: KeyTables = KeyTables {
    aliases: ALIASES,
    open_keys: OPEN_KEYS,
    synonyms: crate::hints::SYNONYMS,
};

impl KeyTables {
    /// The canonical spelling of `key`: an alias (or a key below an alias) is rewritten to verl's name.
    pub fn canonical_key(&self, key: &str) -> String {
        for (alias, canonical) in self.aliases {
            if key == *alias {
                return canonical.to_string();
            }
            if let Some(rest) = key.strip_prefix(alias).and_then(|r| r.strip_prefix('.')) {
                return format!("{canonical}.{rest}");
            }
        }
        key.to_string()
    }

    /// Whether `key` is an open key or lies below one.
    pub fn is_under_open_key(&self, key: &str) -> bool {
        self.open_keys.iter().any(|open| is_at_or_below(key, open))
    }

    /// The assignments a (partial) tree makes, as `(dotted key, value)` pairs: it descends into mappings (except
    /// below open keys, whose mappings are values) and stops at scalars, lists, nulls and empty mappings.
    pub fn assignments(&self, prefix: &str, value: &Value, out: &mut Vec<(String, Value)>) {
        match value {
            Value::Mapping(map) if !map.is_empty() && !self.is_under_open_key(prefix) => {
                for (k, v) in map {
                    let seg = match k {
                        Value::String(s) => s.clone(),
                        other => serde_yaml::to_string(other)
                            .unwrap_or_default()
                            .trim()
                            .to_string(),
                    };
                    let key = if prefix.is_empty() {
                        seg
                    } else {
                        format!("{prefix}.{seg}")
                    };
                    self.assignments(&key, v, out);
                }
            }
            Value::Tagged(t) => self.assignments(prefix, &t.value, out),
            other => out.push((prefix.to_string(), other.clone())),
        }
    }
}

/// The canonical spelling of `key` in [`SFT_KEYS`]: an alias (or a key below an alias) is rewritten to verl's name.
pub fn canonical_key(key: &str) -> String {
    SFT_KEYS.canonical_key(key)
}

/// Whether dotted `key` is `ancestor` or lies below it (on whole segments).
pub fn is_at_or_below(key: &str, ancestor: &str) -> bool {
    key == ancestor
        || key
            .strip_prefix(ancestor)
            .is_some_and(|r| r.starts_with('.'))
}

/// Whether `key` is an open key of [`SFT_KEYS`] or lies below one.
pub fn is_under_open_key(key: &str) -> bool {
    SFT_KEYS.is_under_open_key(key)
}

/// The value at dotted `key`, if present.
pub fn get<'a>(tree: &'a Value, key: &str) -> Option<&'a Value> {
    key.split('.')
        .try_fold(tree, |node, seg| node.as_mapping()?.get(seg))
}

/// Sets dotted `key` to `value`, creating mappings on the way (a null in the way becomes a mapping).
pub fn set(tree: &mut Value, key: &str, value: Value) -> Result<()> {
    let segs: Vec<&str> = key.split('.').collect();
    let mut node = tree;
    for (i, seg) in segs.iter().enumerate() {
        if node.is_null() {
            *node = Value::Mapping(Mapping::new());
        }
        let Some(map) = node.as_mapping_mut() else {
            bail!(
                "`{}` takes a value, not sub-keys (`{key}`)",
                segs[..i].join(".")
            );
        };
        let k = Value::String(seg.to_string());
        if i + 1 == segs.len() {
            map.insert(k, value);
            return Ok(());
        }
        node = map.entry(k).or_insert(Value::Null);
    }
    unreachable!("split always yields at least one segment")
}

/// Removes dotted `key`; returns whether it was present.
pub fn remove(tree: &mut Value, key: &str) -> bool {
    let (parent, last) = match key.rsplit_once('.') {
        Some((p, l)) => (p, l),
        None => ("", key),
    };
    let node = if parent.is_empty() {
        Some(tree)
    } else {
        parent
            .split('.')
            .try_fold(tree, |node, seg| node.as_mapping_mut()?.get_mut(seg))
    };
    node.and_then(|n| n.as_mapping_mut())
        .and_then(|m| m.remove(last))
        .is_some()
}

/// The assignments a (partial) tree makes with [`SFT_KEYS`]' open keys (see [`KeyTables::assignments`]).
pub fn assignments(prefix: &str, value: &Value, out: &mut Vec<(String, Value)>) {
    SFT_KEYS.assignments(prefix, value, out);
}

/// Every `(dotted key, value)` leaf of a tree: scalars, lists, nulls and empty mappings.
pub fn leaves(value: &Value) -> Vec<(String, Value)> {
    let mut out = Vec::new();
    fn walk(prefix: &str, value: &Value, out: &mut Vec<(String, Value)>) {
        match value {
            Value::Mapping(map) if !map.is_empty() => {
                for (k, v) in map {
                    let seg = k.as_str().unwrap_or_default();
                    let key = if prefix.is_empty() {
                        seg.to_string()
                    } else {
                        format!("{prefix}.{seg}")
                    };
                    walk(&key, v, out);
                }
            }
            other => out.push((prefix.to_string(), other.clone())),
        }
    }
    walk("", value, &mut out);
    out
}

/// The valid keys: the tree of defaults, with optional sections (null by default) filled in so their sub-keys are
/// known too.
pub struct Schema {
    keys: KeyTables,
    tree: Value,
    all_keys: Vec<String>,
}

impl Schema {
    /// A schema of [`SFT_KEYS`] from the defaults tree plus `(key, full section)` for sections that default to null.
    pub fn new(defaults: &Value, optional_sections: &[(&str, Value)]) -> Self {
        Self::with_keys(SFT_KEYS, defaults, optional_sections)
    }

    /// A schema from the defaults tree plus `(key, full section)` for sections that default to null, with `keys`'
    /// aliases, open keys and synonyms.
    pub fn with_keys(
        keys: KeyTables,
        defaults: &Value,
        optional_sections: &[(&str, Value)],
    ) -> Self {
        let mut tree = defaults.clone();
        for (key, section) in optional_sections {
            set(&mut tree, key, section.clone()).expect("optional section lies in a mapping");
        }
        let mut all_keys = Vec::new();
        fn walk(prefix: &str, value: &Value, out: &mut Vec<String>) {
            if let Value::Mapping(map) = value {
                for (k, v) in map {
                    let seg = k.as_str().unwrap_or_default();
                    let key = if prefix.is_empty() {
                        seg.to_string()
                    } else {
                        format!("{prefix}.{seg}")
                    };
                    out.push(key.clone());
                    walk(&key, v, out);
                }
            }
        }
        walk("", &tree, &mut all_keys);
        all_keys.extend(keys.aliases.iter().map(|(a, _)| a.to_string()));
        Self {
            keys,
            tree,
            all_keys,
        }
    }

    /// Ok when `key` (canonical spelling) names a config key or lies below an open key; otherwise an error naming
    /// the key and the nearest valid one.
    pub fn check_key(&self, key: &str) -> Result<()> {
        if key.is_empty() || key.split('.').any(str::is_empty) {
            bail!("`{key}` is not a valid config key (empty segment)");
        }
        let mut node = &self.tree;
        let mut path = String::new();
        for seg in key.split('.') {
            if !path.is_empty() && self.keys.is_under_open_key(&path) {
                return Ok(());
            }
            match node {
                Value::Mapping(map) => match map.get(seg) {
                    Some(child) => node = child,
                    None => bail!(
                        "unknown config key `{key}`; did you mean `{}`?",
                        self.nearest(key)
                    ),
                },
                _ => bail!("`{path}` takes a value, not sub-keys (`{key}`)"),
            }
            if !path.is_empty() {
                path.push('.');
            }
            path.push_str(seg);
        }
        Ok(())
    }

    /// The valid key (or alias) `key` most likely means: a known synonym first, else the closest spelling,
    /// preferring the same section (see [`crate::hints`]).
    pub fn nearest(&self, key: &str) -> &str {
        crate::hints::nearest_with(self.keys.synonyms, &self.all_keys, key)
    }

    /// The schema's value at `key` (its default, or the filled-in optional section).
    pub fn default_at(&self, key: &str) -> Option<&Value> {
        get(&self.tree, key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tree(y: &str) -> Value {
        serde_yaml::from_str(y).unwrap()
    }

    #[test]
    fn set_creates_sections_and_refuses_subkeys_of_values() {
        let mut t = tree("a: {b: 1}\nc: null");
        set(&mut t, "a.d.e", Value::from(2)).unwrap();
        set(&mut t, "c.x", Value::from(3)).unwrap();
        assert_eq!(get(&t, "a.d.e"), Some(&Value::from(2)));
        assert_eq!(get(&t, "c.x"), Some(&Value::from(3)));
        let err = set(&mut t, "a.b.z", Value::from(1))
            .unwrap_err()
            .to_string();
        assert!(err.contains("`a.b` takes a value"), "{err}");
        assert!(remove(&mut t, "a.d"));
        assert!(get(&t, "a.d.e").is_none());
        assert!(!remove(&mut t, "nope.x"));
    }

    #[test]
    fn canonical_key_rewrites_aliases_only_on_segment_boundaries() {
        assert_eq!(
            canonical_key("optim.warmup_steps_ratio"),
            "optim.lr_warmup_steps_ratio"
        );
        assert_eq!(canonical_key("trainer.save_interval"), "trainer.save_freq");
        assert_eq!(
            canonical_key("trainer.save_intervals"),
            "trainer.save_intervals"
        );
        assert_eq!(canonical_key("optim.lr"), "optim.lr");
        assert_eq!(
            canonical_key("model.use_remove_padding"),
            "use_remove_padding"
        );
        assert_eq!(
            canonical_key("model.ulysses_sequence_parallel_size"),
            "ulysses_sequence_parallel_size"
        );
        assert_eq!(
            canonical_key("model.use_remove_padding_x"),
            "model.use_remove_padding_x"
        );
        assert_eq!(canonical_key("use_remove_padding"), "use_remove_padding");
    }

    #[test]
    fn assignments_stop_at_open_keys() {
        let t = tree("data: {max_length: 5, apply_chat_template_kwargs: {enable_thinking: false}}");
        let mut out = Vec::new();
        assignments("", &t, &mut out);
        let keys: Vec<&str> = out.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(keys, ["data.max_length", "data.apply_chat_template_kwargs"]);
    }

    #[test]
    fn schema_suggests_nearest_key() {
        let s = Schema::new(
            &tree("data: {prompt_key: q, max_length: 1}\noptim: {lr: 1.0}"),
            &[],
        );
        assert!(s.check_key("data.prompt_key").is_ok());
        let err = s.check_key("data.promt_key").unwrap_err().to_string();
        assert_eq!(
            err,
            "unknown config key `data.promt_key`; did you mean `data.prompt_key`?"
        );
        assert_eq!(s.nearest("lr"), "optim.lr");
        let err = s.check_key("data.max_length.x").unwrap_err().to_string();
        assert!(err.contains("`data.max_length` takes a value"), "{err}");
    }
}
