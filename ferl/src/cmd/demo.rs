//! `ferl demo`: the main job on its embedded default, the steps `scripts/demo.sh` and a pip-installed `ferl` share.
//! A random-init tiny Qwen2 with the real Qwen tokenizer (`ferl model init`), GSM8K as verl's parquet (`ferl data
//! gsm8k`), then SFT with `examples/configs/gsm8k_tiny.yaml` on `--nproc-per-node` ranks of an embedded cluster.
//! Steps whose output is already there are skipped, so a second run only trains.

use std::path::{Path, PathBuf};

use anyhow::{bail, Result};
use clap::Args;
use ferl_trainer::config::SftConfig;

/// What the demo reads, relative to its assets root: the repository's root, or the wheel's `share/ferl`.
const MODEL_CONFIG: &str = "assets/models/tiny-qwen2/config.json";
const TOKENIZER: &str = "assets/tokenizers/qwen3";
const GSM8K: &str = "assets/data/gsm8k";
const SFT_CONFIG: &str = "examples/configs/gsm8k_tiny.yaml";

/// Arguments of `ferl demo`.
#[derive(Args, Debug)]
pub(crate) struct DemoArgs {
    /// Where the model, data and checkpoints go.
    #[arg(long, default_value = "runs/demo")]
    pub out: PathBuf,
    /// Trainer ranks on the embedded cluster.
    #[arg(
        long = "nproc-per-node",
        visible_alias = "nproc_per_node",
        default_value_t = 2
    )]
    pub nproc_per_node: usize,
    /// The folder holding `assets/` and `examples/configs/`: default, the installed package's `share/ferl`
    /// (beside the binary's `lib/ferl`), else the current folder when it is a ferl checkout.
    #[arg(long)]
    pub assets: Option<PathBuf>,
    /// verl overrides on top of the demo config (`key=value`).
    #[arg(value_name = "KEY=VALUE")]
    pub overrides: Vec<String>,
}

/// Makes what is missing (model, data) and trains.
pub(crate) fn run(args: DemoArgs) -> Result<()> {
    let root = assets_root(args.assets.as_deref())?;
    let out = &args.out;
    let model = out.join("model");
    if !model.join("model.safetensors").exists() {
        let tokenizer = root.join(TOKENIZER);
        ferl_trainer::model::init_model(&root.join(MODEL_CONFIG), Some(&tokenizer), &model, 0)?;
        println!("wrote a random-init model to {}", model.display());
    }
    let data = out.join("data");
    if !data.join("train.parquet").exists() {
        let s = ferl_data::gsm8k::prepare_gsm8k(&root.join(GSM8K), &data)?;
        println!(
            "wrote {} ({} rows)",
            data.join("train.parquet").display(),
            s.train_rows
        );
    }
    let mut overrides = vec![
        format!("data.train_files={}", data.join("train.parquet").display()),
        format!("data.val_files={}", data.join("test.parquet").display()),
        format!("model.partial_pretrain={}", model.display()),
        format!(
            "trainer.default_local_dir={}",
            out.join("checkpoints").display()
        ),
    ];
    overrides.extend(args.overrides.iter().cloned());
    let cfg = SftConfig::load(Some(&root.join(SFT_CONFIG)), &overrides)?;
    let dist = super::sft_dist::DistArgs {
        nproc_per_node: Some(args.nproc_per_node),
        nnodes: 1,
        address: None,
    };
    super::sft_dist::run(cfg, &dist)
}

/// The assets root: `--assets`, else `<prefix>/share/ferl` of an installed `<prefix>/lib/ferl/ferl`, else the
/// current folder; refused naming every place looked at when none holds the demo's files.
fn assets_root(given: Option<&Path>) -> Result<PathBuf> {
    let installed = std::env::current_exe()
        .ok()
        .and_then(|exe| Some(exe.parent()?.parent()?.parent()?.join("share/ferl")));
    let candidates: Vec<PathBuf> = match given {
        Some(dir) => vec![dir.to_path_buf()],
        None => installed.into_iter().chain([PathBuf::from(".")]).collect(),
    };
    if let Some(root) = candidates.iter().find(|d| d.join(MODEL_CONFIG).is_file()) {
        return Ok(root.clone());
    }
    let looked: Vec<String> = candidates.iter().map(|d| d.display().to_string()).collect();
    bail!(
        "ferl demo: no {MODEL_CONFIG} under {}: pass --assets with a ferl checkout's root or an installed \
         package's share/ferl",
        looked.join(" or ")
    )
}
