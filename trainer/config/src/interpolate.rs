//! OmegaConf-style interpolation over the config tree: `${path.to.key}`, `${oc.env:VAR}` and
//! `${oc.env:VAR,default}`; `\${` is a literal `${`.
//!
//! A value that is exactly one interpolation takes the referenced value with its type (a list stays a list); an
//! interpolation inside a longer string is spliced in as text. Environment values are typed like override values
//! (`${oc.env:STEPS}` with `STEPS=60` is the integer 60). References are resolved recursively; a cycle is an error.

use std::collections::HashMap;

use anyhow::{anyhow, bail, Result};
use serde_yaml::{Mapping, Value};

use crate::overrides::parse_value;
use crate::tree;

/// Resolves every interpolation in `root`, in place. Errors name the key whose value could not be resolved.
/// References use [`tree::SFT_KEYS`]' spellings.
pub fn resolve_all(root: &mut Value) -> Result<()> {
    resolve_all_with(root, tree::SFT_KEYS)
}

/// [`resolve_all`] for another config type: references may use `keys`' aliases.
pub fn resolve_all_with(root: &mut Value, keys: tree::KeyTables) -> Result<()> {
    let mut r = Resolver {
        keys,
        source: root.clone(),
        done: HashMap::new(),
        stack: Vec::new(),
        copied: 0,
    };
    *root = r.node("", &r.source.clone())?;
    Ok(())
}

struct Resolver {
    keys: tree::KeyTables,
    source: Value,
    done: HashMap<String, Value>,
    stack: Vec<String>,
    /// Size ([`weight`]) of the values references have copied so far.
    copied: usize,
}

/// Most a config's references may copy in all ([`weight`] units, about bytes): references that repeat other
/// references (`b: ${a}${a}`, `c: ${b}${b}`, ...) grow exponentially and are refused past this.
const MAX_COPIED: usize = 1 << 20;

/// The size of a value: the bytes of its strings plus one per node.
fn weight(value: &Value) -> usize {
    match value {
        Value::String(s) => 1 + s.len(),
        Value::Sequence(items) => items.iter().map(weight).sum::<usize>() + 1,
        Value::Mapping(map) => {
            map.iter()
                .map(|(k, v)| weight(k) + weight(v))
                .sum::<usize>()
                + 1
        }
        Value::Tagged(t) => weight(&t.value) + 1,
        _ => 1,
    }
}

enum Part {
    Text(String),
    Interp(String),
}

impl Resolver {
    fn node(&mut self, path: &str, value: &Value) -> Result<Value> {
        if let Some(v) = self.done.get(path) {
            return Ok(v.clone());
        }
        if self.stack.iter().any(|p| p == path) {
            let mut cycle: Vec<String> = self
                .stack
                .iter()
                .filter(|p| !p.is_empty())
                .cloned()
                .collect();
            cycle.push(path.to_string());
            bail!("interpolation cycle: {}", cycle.join(" -> "));
        }
        self.stack.push(path.to_string());
        let out = match value {
            Value::String(s) if s.contains("${") => self.string(path, s)?,
            Value::Mapping(map) => {
                let mut out = Mapping::new();
                for (k, v) in map {
                    let seg = k.as_str().unwrap_or_default();
                    let child = if path.is_empty() {
                        seg.to_string()
                    } else {
                        format!("{path}.{seg}")
                    };
                    out.insert(k.clone(), self.node(&child, v)?);
                }
                Value::Mapping(out)
            }
            Value::Sequence(items) => {
                let mut out = Vec::with_capacity(items.len());
                for (i, v) in items.iter().enumerate() {
                    out.push(self.node(&format!("{path}[{i}]"), v)?);
                }
                Value::Sequence(out)
            }
            other => other.clone(),
        };
        self.stack.pop();
        self.done.insert(path.to_string(), out.clone());
        Ok(out)
    }

    fn string(&mut self, path: &str, s: &str) -> Result<Value> {
        let parts = split(s).map_err(|e| anyhow!("`{}`: {e} in `{s}`", display(path)))?;
        if let [Part::Interp(inner)] = parts.as_slice() {
            return self.interp(path, inner);
        }
        let mut out = String::new();
        for part in parts {
            match part {
                Part::Text(t) => out.push_str(&t),
                Part::Interp(inner) => match self.interp(path, &inner)? {
                    Value::String(v) => out.push_str(&v),
                    Value::Number(n) => out.push_str(&n.to_string()),
                    Value::Bool(b) => out.push_str(if b { "True" } else { "False" }),
                    Value::Null => out.push_str("None"),
                    _ => bail!(
                        "`{}`: `${{{inner}}}` is a list or mapping and cannot be part of a string",
                        display(path)
                    ),
                },
            }
        }
        Ok(Value::String(out))
    }

    fn interp(&mut self, path: &str, inner: &str) -> Result<Value> {
        // The inside may itself hold interpolations (e.g. an env default); resolve it to text first.
        let inner = if inner.contains("${") {
            match self.string(path, inner)? {
                Value::String(s) => s,
                other => serde_yaml::to_string(&other)?.trim().to_string(),
            }
        } else {
            inner.to_string()
        };
        let inner = inner.trim();
        if let Some(rest) = inner.strip_prefix("oc.env:") {
            let (var, default) = match rest.split_once(',') {
                Some((v, d)) => (v.trim(), Some(d.trim())),
                None => (rest.trim(), None),
            };
            return match (std::env::var(var), default) {
                (Ok(v), _) => Ok(parse_value(&v)),
                (Err(_), Some(d)) => Ok(parse_value(d)),
                (Err(_), None) => bail!(
                    "`{}`: environment variable `{var}` is not set (in `${{oc.env:{rest}}}`; give a default with \
                     `${{oc.env:{var},DEFAULT}}`)",
                    display(path)
                ),
            };
        }
        if let Some((resolver, _)) = inner.split_once(':') {
            bail!(
                "`{}`: unknown resolver `{resolver}` in `${{{inner}}}` (ferl knows `oc.env`)",
                display(path)
            );
        }
        let target = self
            .keys
            .canonical_key(inner.strip_prefix('.').unwrap_or(inner));
        let Some(value) = tree::get(&self.source, &target).cloned() else {
            bail!(
                "`{}`: `${{{inner}}}` refers to `{target}`, which is not a config key",
                display(path)
            );
        };
        let resolved = self.node(&target, &value)?;
        self.copied += weight(&resolved);
        if self.copied > MAX_COPIED {
            bail!(
                "`{}`: interpolations copy more than {MAX_COPIED} bytes (values that repeat references to each \
                 other grow exponentially)",
                display(path)
            );
        }
        Ok(resolved)
    }
}

/// Escapes every `${` in the strings of `value` as `\${` (mapping keys are left alone), so that printing a resolved
/// config and loading it again gives the same values.
pub fn escape(value: &mut Value) {
    match value {
        Value::String(s) if s.contains("${") => *s = s.replace("${", "\\${"),
        Value::Sequence(items) => items.iter_mut().for_each(escape),
        Value::Mapping(map) => map.iter_mut().for_each(|(_, v)| escape(v)),
        Value::Tagged(t) => escape(&mut t.value),
        _ => {}
    }
}

fn display(path: &str) -> &str {
    if path.is_empty() {
        "<root>"
    } else {
        path
    }
}

/// Deepest nesting of braces inside one interpolation (`${oc.env:A,${b}}` is 2); deeper is refused, as each level
/// is resolved by a recursive call.
const MAX_NESTING: usize = 16;

/// Splits `s` into literal text and `${...}` interpolations (braces may nest inside one).
fn split(s: &str) -> Result<Vec<Part>> {
    let mut parts = Vec::new();
    let mut text = String::new();
    let bytes = s.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        if s[i..].starts_with("\\${") {
            text.push_str("${");
            i += 3;
        } else if s[i..].starts_with("${") {
            let start = i + 2;
            let mut depth = 1;
            let mut j = start;
            while j < bytes.len() && depth > 0 {
                match bytes[j] {
                    b'{' => depth += 1,
                    b'}' => depth -= 1,
                    _ => {}
                }
                if depth > MAX_NESTING {
                    bail!("interpolations nested more than {MAX_NESTING} deep");
                }
                j += 1;
            }
            if depth != 0 {
                bail!("unclosed `${{`");
            }
            if !text.is_empty() {
                parts.push(Part::Text(std::mem::take(&mut text)));
            }
            parts.push(Part::Interp(s[start..j - 1].to_string()));
            i = j;
        } else {
            let ch = s[i..].chars().next().expect("in bounds");
            text.push(ch);
            i += ch.len_utf8();
        }
    }
    if !text.is_empty() {
        parts.push(Part::Text(text));
    }
    Ok(parts)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn resolve(y: &str) -> Result<Value> {
        let mut v: Value = serde_yaml::from_str(y).unwrap();
        resolve_all(&mut v)?;
        Ok(v)
    }

    #[test]
    fn references_keep_types_and_splice_into_strings() {
        let v = resolve(
            "a: {n: 3, l: [x, y], s: hi}\nb: {n: '${a.n}', l: '${a.l}', s: 'p/${a.s}/${a.n}'}",
        )
        .unwrap();
        assert_eq!(tree::get(&v, "b.n"), Some(&Value::from(3)));
        assert_eq!(tree::get(&v, "b.l"), tree::get(&v, "a.l"));
        assert_eq!(tree::get(&v, "b.s"), Some(&Value::from("p/hi/3")));
    }

    #[test]
    fn chains_resolve_and_cycles_are_named() {
        let v = resolve("a: '${b}'\nb: '${c}/x'\nc: z").unwrap();
        assert_eq!(tree::get(&v, "a"), Some(&Value::from("z/x")));
        let err = resolve("a: '${b}'\nb: '${a}'").unwrap_err().to_string();
        assert!(err.contains("interpolation cycle: a -> b -> a"), "{err}");
    }

    #[test]
    fn env_values_defaults_and_missing_vars() {
        std::env::set_var("FERL_CONFIG_TEST_STEPS", "60");
        std::env::remove_var("FERL_CONFIG_TEST_UNSET");
        let v = resolve(
            "a: '${oc.env:FERL_CONFIG_TEST_STEPS}'\nb: '${oc.env:FERL_CONFIG_TEST_UNSET,7}'\n\
             c: 'x_${oc.env:FERL_CONFIG_TEST_UNSET,dflt}'\nd: '${oc.env:FERL_CONFIG_TEST_UNSET,${c}}'",
        )
        .unwrap();
        assert_eq!(tree::get(&v, "a"), Some(&Value::from(60)));
        assert_eq!(tree::get(&v, "b"), Some(&Value::from(7)));
        assert_eq!(tree::get(&v, "c"), Some(&Value::from("x_dflt")));
        assert_eq!(tree::get(&v, "d"), Some(&Value::from("x_dflt")));
        let err = resolve("s: {k: '${oc.env:FERL_CONFIG_TEST_UNSET}'}")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("`s.k`: environment variable `FERL_CONFIG_TEST_UNSET` is not set"),
            "{err}"
        );
    }

    #[test]
    fn unknown_references_resolvers_and_escapes() {
        let err = resolve("a: '${nope.x}'").unwrap_err().to_string();
        assert!(
            err.contains("`a`: `${nope.x}` refers to `nope.x`, which is not a config key"),
            "{err}"
        );
        let err = resolve("a: '${oc.decode:x}'").unwrap_err().to_string();
        assert!(err.contains("unknown resolver `oc.decode`"), "{err}");
        let v = resolve("a: 'lit \\${x}'").unwrap();
        assert_eq!(tree::get(&v, "a"), Some(&Value::from("lit ${x}")));
        assert!(resolve("a: '${b'")
            .unwrap_err()
            .to_string()
            .contains("unclosed"));
    }

    #[test]
    fn deep_nesting_and_exponential_references_are_refused() {
        // Found by fuzzing: 20,000 nested `${` overflowed the stack; `b: ${a}${a}`, `c: ${b}${b}`... hung.
        let deep = format!("a: '{}x{}'", "${".repeat(20_000), "}".repeat(20_000));
        let err = resolve(&deep).unwrap_err().to_string();
        assert!(err.contains("nested more than 16 deep"), "{err}");
        let mut bomb = "k0: xxxxxxxx".to_string();
        for i in 1..40 {
            bomb += &format!("\nk{i}: '${{k{}}}${{k{}}}'", i - 1, i - 1);
        }
        let err = resolve(&bomb).unwrap_err().to_string();
        assert!(
            err.contains("interpolations copy more than 1048576 bytes"),
            "{err}"
        );
    }

    #[test]
    fn escaped_values_print_escaped() {
        let mut v = resolve("a: 'lit \\${x}'\nb: [plain, '\\${y}']").unwrap();
        escape(&mut v);
        let again = resolve(&serde_yaml::to_string(&v).unwrap()).unwrap();
        assert_eq!(tree::get(&again, "a"), Some(&Value::from("lit ${x}")));
        assert_eq!(
            tree::get(&again, "b"),
            Some(&serde_yaml::from_str("[plain, '${y}']").unwrap())
        );
    }
}
