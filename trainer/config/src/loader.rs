//! The loading machinery every config type shares ([`SftConfig`](crate::SftConfig),
//! [`PpoConfig`](crate::PpoConfig)): defaults, a YAML file, overrides, interpolation, typing, range checks, and the
//! changed-key report [`Supported`](crate::Supported) checks. A config type plugs in through [`Kind`].

use std::collections::{BTreeSet, HashMap};
use std::path::Path;

use anyhow::{bail, Context, Result};
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_yaml::Value;

use crate::overrides::Override;
use crate::{interpolate, tree};

/// What a config type tells the shared loader.
pub(crate) trait Kind: Serialize + DeserializeOwned + Default {
    /// Its aliases, open keys and synonyms.
    const KEYS: tree::KeyTables;
    /// Its top-level sections, as named when a file is not a mapping (`data, model, optim, trainer`).
    const SECTIONS: &'static str;
    /// Keys whose default follows another key: `(key, "${other.key}")`. The typed default holds the value the
    /// reference has by default; the loader's tree of defaults holds the reference, so the key follows the other
    /// one unless the user sets it, and [`changed_keys`] does not report it for following.
    const LINKS: &'static [(&'static str, &'static str)] = &[];

    /// `(key, full section)` for sections that default to null, so their sub-keys are known.
    fn optional_sections() -> Vec<(&'static str, Value)> {
        Vec::new()
    }

    /// The value stored when the user assigns `value` to canonical `key`.
    fn on_assign(_key: &str, value: Value) -> Value {
        value
    }

    /// Input-only spellings mapped onto canonical keys after interpolation (see [`crate::spellings`]).
    fn resolve_spellings(_tree: &mut Value, _explicit: &BTreeSet<String>) -> Result<()> {
        Ok(())
    }

    /// Range and consistency checks (the type's `validate`).
    fn check(&self) -> Result<()>;
}

/// Loads a `C`: defaults, then `file` (YAML) if given, then `overrides`, then interpolation, typing and checks.
pub(crate) fn load<C: Kind>(file: Option<&Path>, overrides: &[String]) -> Result<C> {
    let text = match file {
        Some(f) => Some(
            std::fs::read_to_string(f)
                .with_context(|| format!("reading config {}", f.display()))?,
        ),
        None => None,
    };
    let source = file.map(|f| f.display().to_string()).unwrap_or_default();
    build(text.as_deref().map(|t| (t, source.as_str())), overrides)
}

/// Loads a `C` from `(file text, file name)` and overrides.
pub(crate) fn build<C: Kind>(file: Option<(&str, &str)>, overrides: &[String]) -> Result<C> {
    let mut loader = Loader::<C>::new();
    if let Some((text, name)) = file {
        loader.file(text, name)?;
    }
    for arg in overrides {
        loader.override_arg(arg)?;
    }
    loader.finish()
}

/// The config as YAML with every `${` escaped; it loads back to the same config.
pub(crate) fn to_yaml<C: Serialize>(cfg: &C) -> String {
    let mut tree = to_tree(cfg);
    interpolate::escape(&mut tree);
    serde_yaml::to_string(&tree).expect("a config always serialises")
}

/// The config as an untyped tree.
pub(crate) fn to_tree<C: Serialize>(cfg: &C) -> Value {
    serde_yaml::to_value(cfg).expect("a config always serialises")
}

/// The tree the loader starts from: the typed defaults with [`Kind::LINKS`] put back as references.
pub(crate) fn defaults_tree<C: Kind>() -> Value {
    let mut tree = to_tree(&C::default());
    for (key, reference) in C::LINKS {
        tree::set(&mut tree, key, Value::String(reference.to_string()))
            .expect("a link names a key of the defaults");
    }
    tree
}

/// The valid keys of `C`.
pub(crate) fn schema<C: Kind>(defaults: &Value) -> tree::Schema {
    tree::Schema::with_keys(C::KEYS, defaults, &C::optional_sections())
}

/// Every leaf key of `cfg` whose value differs from `resolved_default`'s, in key order; a [`Kind::LINKS`] key whose
/// value is what its reference gives in `cfg` is not reported (it follows a key that is, if changed).
pub(crate) fn changed_keys<C: Kind>(cfg: &C, resolved_default: &C) -> Vec<(String, Value)> {
    let defaults: HashMap<String, Value> = tree::leaves(&to_tree(resolved_default))
        .into_iter()
        .collect();
    let current = to_tree(cfg);
    let followed = following(&current, C::KEYS, C::LINKS);
    tree::leaves(&current)
        .into_iter()
        .filter(|(k, v)| defaults.get(k) != Some(v))
        .filter(|(k, v)| followed.get(k) != Some(v))
        .collect()
}

/// The value each link key would have in `current` if it followed its reference.
fn following(
    current: &Value,
    keys: tree::KeyTables,
    links: &[(&str, &str)],
) -> HashMap<String, Value> {
    if links.is_empty() {
        return HashMap::new();
    }
    let mut linked = current.clone();
    for (key, reference) in links {
        let _ = tree::set(&mut linked, key, Value::String(reference.to_string()));
    }
    if interpolate::resolve_all_with(&mut linked, keys).is_err() {
        return HashMap::new();
    }
    links
        .iter()
        .filter_map(|(key, _)| Some((key.to_string(), tree::get(&linked, key)?.clone())))
        .collect()
}

/// The tree of defaults with the file's and the overrides' assignments applied, and the canonical keys the user
/// set (which [`Kind::resolve_spellings`] needs to tell a conflicting key from a default).
struct Loader<C> {
    defaults: Value,
    schema: tree::Schema,
    tree: Value,
    explicit: BTreeSet<String>,
    kind: std::marker::PhantomData<C>,
}

impl<C: Kind> Loader<C> {
    fn new() -> Self {
        let defaults = defaults_tree::<C>();
        Self {
            schema: schema::<C>(&defaults),
            tree: defaults.clone(),
            defaults,
            explicit: BTreeSet::new(),
            kind: std::marker::PhantomData,
        }
    }

    /// Applies a YAML file's keys (a Hydra `defaults:` list is ignored).
    fn file(&mut self, text: &str, name: &str) -> Result<()> {
        let parsed: Value =
            serde_yaml::from_str(text).with_context(|| format!("parsing config {name}"))?;
        let mut sets = Vec::new();
        match parsed {
            Value::Null => {}
            Value::Mapping(mut map) => {
                map.remove("defaults");
                C::KEYS.assignments("", &Value::Mapping(map), &mut sets);
            }
            _ => bail!(
                "config {name}: expected a mapping of sections ({})",
                C::SECTIONS
            ),
        }
        for (key, value) in sets {
            self.assign(&key, value)
                .with_context(|| format!("in config {name}"))?;
        }
        Ok(())
    }

    /// Applies one command-line override.
    fn override_arg(&mut self, arg: &str) -> Result<()> {
        let result = match Override::parse(arg)? {
            Override::Set { key, value } => {
                let mut sets = Vec::new();
                C::KEYS.assignments(&key, &value, &mut sets);
                sets.into_iter().try_for_each(|(k, v)| self.assign(&k, v))
            }
            Override::Reset { key } => self.reset(&key),
        };
        result.with_context(|| format!("in override `{arg}`"))
    }

    /// Applies one assignment after checking its key.
    fn assign(&mut self, key: &str, value: Value) -> Result<()> {
        let key = C::KEYS.canonical_key(key);
        self.schema.check_key(&key)?;
        // `section:` with nothing under it in YAML is null: it leaves the section's defaults alone.
        let is_section =
            matches!(self.schema.default_at(&key), Some(Value::Mapping(m)) if !m.is_empty());
        if value.is_null() && is_section && !C::KEYS.is_under_open_key(&key) {
            let optional = matches!(tree::get(&self.defaults, &key), Some(Value::Null));
            if !optional {
                return Ok(());
            }
        }
        tree::set(&mut self.tree, &key, C::on_assign(&key, value))?;
        self.explicit.insert(key);
        Ok(())
    }

    /// `~key`: back to the default (or absent), and no longer set by the user.
    fn reset(&mut self, key: &str) -> Result<()> {
        let key = C::KEYS.canonical_key(key);
        self.schema.check_key(&key)?;
        match tree::get(&self.defaults, &key) {
            Some(v) => tree::set(&mut self.tree, &key, v.clone())?,
            None => {
                tree::remove(&mut self.tree, &key);
            }
        }
        self.explicit.retain(|k| !tree::is_at_or_below(k, &key));
        Ok(())
    }

    /// Interpolation, spellings, typing and range checks.
    fn finish(mut self) -> Result<C> {
        interpolate::resolve_all_with(&mut self.tree, C::KEYS)?;
        C::resolve_spellings(&mut self.tree, &self.explicit)?;
        let cfg: C = from_tree(&self.tree)?;
        cfg.check()?;
        Ok(cfg)
    }
}

/// Types a resolved tree. Going through YAML text lets a plain scalar fill a string key (`experiment_name=123`).
fn from_tree<C: DeserializeOwned>(tree: &Value) -> Result<C> {
    let text = serde_yaml::to_string(tree)?;
    serde_yaml::from_str(&text).map_err(|e| {
        let msg = e.to_string();
        let msg = match msg.find(" at line ") {
            Some(i) => &msg[..i],
            None => &msg,
        };
        match msg.split_once(": ") {
            Some((path, what)) if !path.contains(' ') => {
                anyhow::anyhow!("bad value for `{path}`: {what}")
            }
            _ => anyhow::anyhow!("bad config value: {msg}"),
        }
    })
}
