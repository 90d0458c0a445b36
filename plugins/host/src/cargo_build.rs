//! Building a plugin crate with cargo into its own target folder (used by tests and `ferl plugin build`-style
//! tooling). A separate target folder means this works while another cargo holds the workspace's build lock.

use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};
use std::process::Command;

/// What to build.
#[derive(Clone, Debug, Default)]
pub struct PluginBuild {
    /// The cargo package of the plugin.
    pub package: String,
    /// Cargo features to enable.
    pub features: Vec<String>,
    /// Extra environment for the build (e.g. a version baked in with `option_env!`).
    pub env: Vec<(String, String)>,
    /// Build with `--release`.
    pub release: bool,
}

/// The workspace root, found from a crate's manifest folder by walking up to the `Cargo.toml` with `[workspace]`.
pub fn workspace_root(from: &Path) -> Result<PathBuf> {
    for dir in from.ancestors() {
        let manifest = dir.join("Cargo.toml");
        if std::fs::read_to_string(&manifest).is_ok_and(|s| s.contains("[workspace]")) {
            return Ok(dir.to_path_buf());
        }
    }
    bail!("no workspace Cargo.toml above {}", from.display())
}

/// The file name cargo gives the cdylib of `package` on this platform.
pub fn cdylib_file_name(package: &str) -> String {
    format!(
        "{}{}{}",
        std::env::consts::DLL_PREFIX,
        package.replace('-', "_"),
        std::env::consts::DLL_SUFFIX
    )
}

/// Runs `cargo build -p PACKAGE --lib` in `workspace` with target folder `target_dir`; returns the built cdylib.
/// Cargo's output is in the error when the build fails.
pub fn build_plugin(workspace: &Path, target_dir: &Path, spec: &PluginBuild) -> Result<PathBuf> {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.current_dir(workspace)
        .args(["build", "--quiet", "--lib", "-p", &spec.package])
        .arg("--target-dir")
        .arg(target_dir);
    if !spec.features.is_empty() {
        cmd.arg("--features").arg(spec.features.join(","));
    }
    if spec.release {
        cmd.arg("--release");
    }
    for (k, v) in &spec.env {
        cmd.env(k, v);
    }
    let out = cmd
        .output()
        .with_context(|| format!("cannot run cargo to build plugin {}", spec.package))?;
    if !out.status.success() {
        bail!(
            "cargo build of plugin {} failed:\n{}",
            spec.package,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let file = target_dir
        .join(if spec.release { "release" } else { "debug" })
        .join(cdylib_file_name(&spec.package));
    if !file.is_file() {
        bail!(
            "cargo built plugin {} but {} is missing (is it a cdylib crate?)",
            spec.package,
            file.display()
        );
    }
    Ok(file)
}
