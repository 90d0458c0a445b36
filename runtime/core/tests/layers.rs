//! The runtime's layers (design decision 15), bottom up: codec → protocol (the `ferl-wire` crate) → security →
//! transport → actor → control → cluster. Each layer uses only those below it. This test reads every source file
//! of `runtime/core/src` and `runtime/wire/src`, finds each path into the crate (`crate::x`, `super::` chains that leave
//! a layer, `crate::name!` macros) and fails naming the file, the line and the import when a file uses a layer above
//! its own, or a file is in no layer.

use std::path::{Path, PathBuf};

/// The layers, bottom up. A file's layer is the first component of its path under `src/` (a folder, or a file
/// without `.rs`); the facade files (`lib.rs`, the `testing` hooks, the `testbed` actors, binaries) sit above all.
const LAYERS: &[&str] = &[
    "codec",
    "protocol",
    "security",
    "transport",
    "actor",
    "control",
    "cluster",
];
const FACADE: &[&str] = &["lib", "testing", "testbed", "bin"];

/// Macros exported at the crate root, and the layer that defines each.
const MACROS: &[(&str, &str)] = &[
    ("message", "codec"),
    ("stream_message", "codec"),
    ("actor_dispatch", "actor"),
    ("register_actor", "actor"),
];

/// Known exceptions: (file, imported layer). Empty: every file keeps to its layer.
const ALLOWED: &[(&str, &str)] = &[];

fn rank(layer: &str) -> Option<usize> {
    if FACADE.contains(&layer) || layer == "session" {
        // `session` is the facade's public module of re-exports (lib.rs).
        return Some(LAYERS.len());
    }
    LAYERS.iter().position(|l| *l == layer)
}

fn files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The module path of a file under `src/` (`transport/bulk/inbox.rs` → `[transport, bulk, inbox]`).
fn module_path(rel: &Path) -> Vec<String> {
    let mut parts: Vec<String> = rel
        .iter()
        .map(|p| p.to_string_lossy().trim_end_matches(".rs").to_string())
        .collect();
    if matches!(parts.last().map(String::as_str), Some("mod" | "lib")) {
        parts.pop();
    }
    parts
}

/// The code of a line without its `//` comment (doc comments included: links there are not dependencies).
fn code(line: &str) -> &str {
    let mut in_str = false;
    let bytes = line.as_bytes();
    for i in 0..bytes.len() {
        match bytes[i] {
            b'"' if i == 0 || bytes[i - 1] != b'\\' => in_str = !in_str,
            b'/' if !in_str && bytes.get(i + 1) == Some(&b'/') => return &line[..i],
            _ => {}
        }
    }
    line
}

fn ident_at(s: &str) -> &str {
    let end = s
        .find(|c: char| !(c.is_alphanumeric() || c == '_'))
        .unwrap_or(s.len());
    &s[..end]
}

/// The top-level names a `crate::` path at `rest` (the text after `crate::`) reaches: one, or each entry of a
/// `{...}` group.
fn targets(rest: &str) -> Vec<(String, bool)> {
    if let Some(group) = rest.strip_prefix('{') {
        let mut out = Vec::new();
        let mut depth = 0;
        let mut start = 0;
        for (i, c) in group.char_indices() {
            match c {
                '{' => depth += 1,
                '}' if depth == 0 => {
                    out.push(group[start..i].trim());
                    break;
                }
                '}' => depth -= 1,
                ',' if depth == 0 => {
                    out.push(group[start..i].trim());
                    start = i + 1;
                }
                _ => {}
            }
        }
        return out
            .into_iter()
            .filter(|s| !s.is_empty())
            .map(|s| (ident_at(s).to_string(), false))
            .collect();
    }
    let name = ident_at(rest);
    let is_macro = rest[name.len()..].starts_with('!');
    vec![(name.to_string(), is_macro)]
}

/// Every (line number, import text, target layer) of one file, with `super::` chains resolved from `module`.
fn imports(text: &str, module: &[String]) -> Vec<(usize, String, String)> {
    let mut out = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let line = code(line);
        let mut at = 0;
        while let Some(i) = line[at..].find("crate::").map(|i| i + at) {
            at = i + "crate::".len();
            if line[..i].ends_with('$')
                || line[..i].ends_with(|c: char| c.is_alphanumeric() || c == '_')
            {
                continue; // `$crate::` in a macro: the defining crate's root, checked where it is expanded.
            }
            for (name, is_macro) in targets(&line[at..]) {
                let layer = if is_macro {
                    MACROS
                        .iter()
                        .find(|(m, _)| *m == name)
                        .map_or(format!("macro {name}!"), |(_, l)| l.to_string())
                } else {
                    name.clone()
                };
                out.push((n + 1, format!("crate::{}", &line[at..].trim_end()), layer));
            }
        }
        // `super::` chains that climb to the crate root name a top-level module.
        let mut at = 0;
        while let Some(i) = line[at..].find("super::").map(|i| i + at) {
            if line[..i].ends_with("::") {
                at = i + 1;
                continue; // counted from the first `super` of the chain
            }
            let mut rest = &line[i..];
            let mut depth = 0;
            while let Some(r) = rest.strip_prefix("super::") {
                depth += 1;
                rest = r;
            }
            at = i + "super::".len() * depth;
            // A file's own module is `module`; its parent is one `super` up (a `mod tests` inside adds one more,
            // which can only make the chain stay lower).
            if depth >= module.len() {
                for (name, _) in targets(rest)
                    .into_iter()
                    .filter(|(n, _)| !n.is_empty() && n != "self")
                {
                    out.push((n + 1, line[i..].trim().to_string(), name));
                }
            }
        }
    }
    out
}

#[test]
fn every_module_uses_only_the_layers_below_it() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut violations = Vec::new();
    let mut allowed_seen = Vec::new();
    let mut checked = 0;
    for src in [root.join("src"), root.join("../wire/src")] {
        let mut all = Vec::new();
        files(&src, &mut all);
        all.sort();
        for file in all {
            let rel = file.strip_prefix(&src).unwrap();
            let module = module_path(rel);
            let top = module.first().map_or("lib".to_string(), |m| m.clone());
            let shown = file.strip_prefix(root).unwrap().display().to_string();
            let Some(own) = rank(&top) else {
                violations.push(format!(
                    "{shown}: module `{top}` is in no layer (add it to a layer's folder, or to LAYERS)"
                ));
                continue;
            };
            checked += 1;
            if own == LAYERS.len() {
                continue; // the facade may use every layer
            }
            let text = std::fs::read_to_string(&file).unwrap();
            for (line, import, target) in imports(&text, &module) {
                let Some(theirs) = rank(&target) else {
                    // A name re-exported by the facade (`crate::Cluster`) hides which layer it comes from.
                    violations.push(format!(
                        "{shown}:{line}: `{import}` goes through the crate root (`{target}` is no layer): \
                         name the module it comes from"
                    ));
                    continue;
                };
                if theirs > own {
                    if ALLOWED.contains(&(shown.as_str(), target.as_str())) {
                        allowed_seen.push(format!("{shown}:{line}: `{import}`"));
                        continue;
                    }
                    violations.push(format!(
                        "{shown}:{line}: layer `{top}` uses `{target}`, a layer above it: `{import}`"
                    ));
                }
            }
        }
    }
    for a in &allowed_seen {
        println!("allowed exception: {a}");
    }
    assert!(
        checked > 30,
        "only {checked} files found: is the layout still there?"
    );
    assert!(
        violations.is_empty(),
        "layering violations (order: {}):\n{}",
        LAYERS.join(" → "),
        violations.join("\n")
    );
}

/// The layers that may read the process environment: the bootstrap layer (`cluster`, whose `config::lookup` is the
/// runtime's one lookup function) and the facade.
const READS_ENV: &[&str] = &["cluster"];

#[test]
fn no_module_below_the_bootstrap_layer_reads_the_environment() {
    // Settings are read once, through `cluster::config::lookup`, into a `RuntimeConfig` that is passed down.
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut found = Vec::new();
    for src in [root.join("src"), root.join("../wire/src")] {
        let mut all = Vec::new();
        files(&src, &mut all);
        for file in all {
            let module = module_path(file.strip_prefix(&src).unwrap());
            let top = module.first().map_or("lib".to_string(), |m| m.clone());
            if FACADE.contains(&top.as_str()) || READS_ENV.contains(&top.as_str()) {
                continue;
            }
            let text = std::fs::read_to_string(&file).unwrap();
            for (n, line) in text.lines().enumerate() {
                if ["env::var", "env::vars"]
                    .iter()
                    .any(|p| code(line).contains(p))
                {
                    let shown = file.strip_prefix(root).unwrap().display();
                    found.push(format!("{shown}:{}: {}", n + 1, line.trim()));
                }
            }
        }
    }
    assert!(
        found.is_empty(),
        "the environment is read below the bootstrap layer (read it in RuntimeConfig::from_lookup and pass it \
         down):\n{}",
        found.join("\n")
    );
    // And the check sees a read where there is one.
    assert!(code("    let v = std::env::var(\"X\"); // why").contains("env::var"));
    assert!(!code("// std::env::var in a comment").contains("env::var"));
}

#[test]
fn lib_rs_is_a_facade() {
    // Every layer is a private module; the only public modules are the facade's `session` (re-exports for the
    // CLI) and, with the `testing` feature, the test actors and hooks.
    let lib =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("src/lib.rs")).unwrap();
    for line in lib.lines().map(str::trim) {
        if let Some(name) = line.strip_prefix("pub mod ") {
            let name = ident_at(name);
            assert!(
                ["session", "testbed", "testing"].contains(&name),
                "src/lib.rs: `pub mod {name}`: layers are private, export items with `pub use`"
            );
        }
        if let Some(name) = line.strip_prefix("mod ") {
            let name = ident_at(name);
            assert!(
                LAYERS.contains(&name),
                "src/lib.rs: `mod {name}` is in no layer (add it to LAYERS, or under a layer's folder)"
            );
        }
    }
    for layer in &LAYERS[2..] {
        assert!(
            lib.lines().any(|l| l.trim() == format!("mod {layer};")),
            "src/lib.rs does not declare the private module `{layer}`"
        );
    }
}

#[test]
fn the_wire_crate_is_the_bottom_two_layers() {
    // `ferl-wire` holds codec and protocol, and codec does not use protocol: checked above. Here: its manifest
    // depends on no QUIC or TLS crate, so message-only crates stay light.
    let manifest =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../wire/Cargo.toml"))
            .unwrap();
    for heavy in ["quinn", "rustls", "rcgen", "ferl-runtime"] {
        assert!(
            !manifest.contains(heavy),
            "ferl-wire must not depend on {heavy}"
        );
    }
}

#[test]
fn the_checker_sees_violations() {
    let module = vec!["transport".to_string(), "peer".to_string()];
    let found = imports(
        "use crate::actor::process::Process;\n/// [`crate::cluster`] in a doc\nuse crate::{codec::Wire, control::head};\n",
        &module,
    );
    let layers: Vec<_> = found.iter().map(|(_, _, l)| l.as_str()).collect();
    assert_eq!(layers, ["actor", "codec", "control"]);
    let found = imports(
        "use super::super::cluster::Cluster;",
        &["actor".to_string()],
    );
    assert_eq!(found[0].2, "cluster");
    assert_eq!(imports("crate::register_actor!(X);", &module)[0].2, "actor");
}
