//! Helpers shared by the host's integration tests: build a plugin crate (in its own target folder under the system
//! temp dir, so this works under `cargo test` and `cargo nextest` alike) and copy it where a test wants it.

#![allow(dead_code)]

use ferl_plugin_host::cargo_build::{build_plugin, workspace_root, PluginBuild};
use std::path::{Path, PathBuf};

/// Builds `package` with `features` and `env`; returns the cdylib (cached between runs by cargo).
pub(crate) fn build(package: &str, features: &[&str], env: &[(&str, &str)]) -> PathBuf {
    let ws = workspace_root(Path::new(env!("CARGO_MANIFEST_DIR"))).expect("workspace root");
    let mut key = package.to_string();
    for f in features {
        key.push('-');
        key.push_str(f);
    }
    for (k, v) in env {
        key.push_str(&format!("-{k}={v}"));
    }
    let target = std::env::temp_dir().join("ferl-plugin-builds").join(key);
    let spec = PluginBuild {
        package: package.to_string(),
        features: features.iter().map(|s| s.to_string()).collect(),
        env: env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        release: false,
    };
    build_plugin(&ws, &target, &spec).unwrap_or_else(|e| panic!("{e:#}"))
}

/// Builds `package` and copies the library to `dir/name` (a file name ending in the platform's library suffix).
pub(crate) fn build_into(
    package: &str,
    features: &[&str],
    env: &[(&str, &str)],
    dir: &Path,
    name: &str,
) -> PathBuf {
    let built = build(package, features, env);
    let dest = dir.join(format!("{name}{}", std::env::consts::DLL_SUFFIX));
    std::fs::copy(&built, &dest).expect("copy plugin");
    dest
}

/// The testkit logger of version `v`.
pub(crate) fn testkit_logger(v: &str) -> PathBuf {
    build("ferl-plugin-testkit", &[], &[("FERL_TESTKIT_VERSION", v)])
}
