//! What the RL tests share: the plugin template's exact-match reward built as a plugin, and the digit task as a user
//! would bring it to `ferl grpo` — a tiny Qwen2 whose word-level tokenizer (vocabulary 16) and chat template are in
//! its model folder, and prompts in verl's RL layout.

use std::path::PathBuf;

use ferl::plugins::cargo_build::{build_plugin, workspace_root, PluginBuild};

use crate::repo_root;

/// The plugin template's exact-match reward (`--features reward`, named `template-reward`), built once into the
/// cache the tests share.
pub fn template_reward() -> PathBuf {
    let ws = workspace_root(&repo_root()).unwrap();
    let spec = PluginBuild {
        package: "ferl-plugin-template".into(),
        features: vec!["reward".into()],
        ..Default::default()
    };
    let target = std::env::temp_dir()
        .join("ferl-plugin-builds")
        .join("ferl-plugin-template-reward");
    build_plugin(&ws, &target, &spec).unwrap_or_else(|e| panic!("{e:#}"))
}

pub use ferl_rl::digits::{write_digit_model, write_digit_prompts};
