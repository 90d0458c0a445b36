//! Fuzzing the config loader: a YAML file and dotted overrides (`key=value`, `+key=value`, `~key`, interpolations),
//! as `ferl sft` gets them. No panic, no hang, every refusal an error; an accepted config prints (`--cfg job`) as
//! YAML that loads back to the same config.
//!
//! An input is UTF-8 text: the YAML file, then, after a line `%%`, one override per line (no YAML part: no file).

use ferl_config::SftConfig;
use ferl_fuzz::{Answer, Expect, Target};
use proptest::prelude::*;
use proptest::sample::select;
use serde_yaml::Value;

const SEPARATOR: &str = "\n%%\n";

fn load(input: &[u8]) -> Answer {
    let text = std::str::from_utf8(input).map_err(|e| format!("not UTF-8: {e}"))?;
    let (yaml, overrides) = text.split_once(SEPARATOR).unwrap_or((text, ""));
    let overrides: Vec<String> = overrides.lines().map(String::from).collect();
    let loaded = if yaml.trim().is_empty() {
        SftConfig::load(None, &overrides)
    } else {
        SftConfig::from_yaml(yaml, &overrides)
    };
    let cfg = loaded.map_err(|e| format!("{e:#}"))?;
    let printed = cfg.to_yaml();
    let again = SftConfig::from_yaml(&printed, &[])
        .unwrap_or_else(|e| panic!("the printed config does not load back: {e:#}\n{printed}"));
    assert_eq!(
        again.to_yaml(),
        printed,
        "the printed config loads back to another config"
    );
    Ok(())
}

/// Every key of the config, with its default.
fn leaves() -> Vec<(String, Value)> {
    let tree = serde_yaml::to_value(SftConfig::default()).expect("the defaults serialise");
    ferl_config::tree::leaves(&tree)
}

fn value_text(keys: Vec<String>) -> impl Strategy<Value = String> {
    prop_oneof![
        any::<i64>().prop_map(|n| n.to_string()),
        any::<f64>().prop_map(|f| f.to_string()),
        select(vec![
            "true", "False", "null", "~", "", "[]", "{}", "[a,b]", "{a: 1}", "'quoted'", "1e-4",
            "-1", "NaN"
        ])
        .prop_map(String::from),
        "[a-z_/.]{0,12}",
        select(keys).prop_map(|k| format!("${{{k}}}")),
        select(vec![
            "${oc.env:HOME}",
            "${oc.env:FERL_FUZZ_UNSET,7}",
            "${oc.env:FERL_FUZZ_UNSET}",
            "\\${x}",
            "${a:b}"
        ])
        .prop_map(String::from),
    ]
}

fn override_line(keys: Vec<String>) -> impl Strategy<Value = String> {
    let prefix = select(vec!["", "+", "++", "~"]);
    (prefix, select(keys.clone()), value_text(keys)).prop_map(|(p, k, v)| {
        if p == "~" {
            format!("~{k}")
        } else {
            format!("{p}{k}={v}")
        }
    })
}

/// A YAML file setting some keys (through the nested form) and some overrides.
fn config_text() -> impl Strategy<Value = Vec<u8>> {
    let keys: Vec<String> = leaves().into_iter().map(|(k, _)| k).collect();
    let yaml = prop::collection::vec((select(keys.clone()), value_text(keys.clone())), 0..6)
        .prop_map(|sets| {
            let mut tree = Value::Mapping(Default::default());
            for (key, text) in sets {
                let _ = ferl_config::tree::set(
                    &mut tree,
                    &key,
                    ferl_config::overrides::parse_value(&text),
                );
            }
            if tree.as_mapping().is_some_and(|m| m.is_empty()) {
                String::new()
            } else {
                serde_yaml::to_string(&tree).expect("a tree serialises")
            }
        });
    let overrides = prop::collection::vec(override_line(keys), 0..6);
    (yaml, overrides).prop_map(|(yaml, overrides)| {
        format!("{yaml}{SEPARATOR}{}", overrides.join("\n")).into_bytes()
    })
}

/// Interpolations that refer to each other, each doubling the text of the one before, or nesting deeply.
fn interpolation_bombs() -> impl Strategy<Value = Vec<u8>> {
    let strings: Vec<String> = leaves()
        .into_iter()
        .filter(|(_, v)| v.is_string())
        .map(|(k, _)| k)
        .collect();
    let most = strings.len().min(24);
    let chain =
        (prop::sample::subsequence(strings, 2..most), 1..4usize).prop_map(|(keys, copies)| {
            let mut lines = vec![format!("{}=xxxxxxxx", keys[0])];
            for pair in keys.windows(2) {
                lines.push(format!(
                    "{}={}",
                    pair[1],
                    format!("${{{}}}", pair[0]).repeat(copies + 1)
                ));
            }
            format!("{SEPARATOR}{}", lines.join("\n")).into_bytes()
        });
    let nested = (1..20_000usize).prop_map(|depth| {
        format!(
            "{SEPARATOR}trainer.project_name={}x{}",
            "${".repeat(depth),
            "}".repeat(depth)
        )
        .into_bytes()
    });
    prop_oneof![chain, nested]
}

#[test]
fn fuzz_config_yaml_and_overrides() {
    Target::new("config", load)
        .generate("configs", config_text(), Expect::Any)
        .generate("interpolation bombs", interpolation_bombs(), Expect::Any)
        .dictionary(&[
            b"${",
            b"}",
            b"${oc.env:",
            b"\\${",
            b"%%\n",
            b"\n",
            b": ",
            b"- ",
            b"[",
            b"]",
            b"{",
            b"}",
            b"&a ",
            b"*a",
            b"<<: ",
            b"!!str ",
            b"!!binary ",
            b"~",
            b"+",
            b"++",
            b"=",
            b"data.",
            b"model.",
            b"trainer.",
            b"optim.",
            b"fsdp_config.",
            b"defaults:\n  - _self_\n",
        ])
        .max_len(64 << 10)
        .run();
}
