//! One module per `ferl` subcommand.

pub(crate) mod cluster;
pub(crate) mod data;
pub(crate) mod demo;
pub(crate) mod export;
pub(crate) mod generate;
pub(crate) mod grpo;
pub(crate) mod job;
pub(crate) mod logs;
pub(crate) mod model;
pub(crate) mod plot;
pub(crate) mod plugin;
pub(crate) mod sft;
pub(crate) mod sft_dist;

/// The config arguments of the training subcommands (`ferl sft`, `ferl grpo`): a verl YAML file, Hydra-style
/// overrides, and `--cfg job`.
#[derive(clap::Args, Debug)]
pub(crate) struct ConfigArgs {
    /// A YAML file with verl's keys (`sft_trainer.yaml`'s for `sft`, `ppo_trainer.yaml`'s for `grpo`).
    #[arg(long)]
    pub config: Option<std::path::PathBuf>,
    /// `--cfg job` prints the resolved config and exits without training.
    #[arg(long = "cfg", value_name = "job")]
    pub cfg: Option<String>,
    /// Overrides: `a.b=c`, `+a.b=c`, `~a.b`, lists as `[x,y]`.
    #[arg(value_name = "KEY=VALUE")]
    pub overrides: Vec<String>,
}

impl ConfigArgs {
    /// With `--cfg job`, prints `yaml()` and returns `true` (nothing is to run); refuses any other `--cfg`.
    pub(crate) fn print_job(&self, yaml: impl FnOnce() -> String) -> anyhow::Result<bool> {
        match self.cfg.as_deref() {
            Some("job") => {
                print!("{}", yaml());
                Ok(true)
            }
            Some(other) => anyhow::bail!("--cfg {other}: only `--cfg job` is supported"),
            None => Ok(false),
        }
    }
}

/// Says where the run's picture is (`curves.png` in its folder), when it drew one.
pub(crate) fn print_curves(run_dir: &std::path::Path) {
    let curves = run_dir.join(ferl_plot::CURVES_FILE);
    if curves.is_file() {
        println!("curves: {}", curves.display());
    }
}
