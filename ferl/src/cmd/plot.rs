//! `ferl plot RUN_DIR_OR_METRICS.jsonl [--metrics train/loss,val/loss] [--out curves.png|curves.svg]`: a run's
//! curves as a picture, without a server ([`ferl_plot`]).

use anyhow::Result;
use clap::Args;
use std::path::PathBuf;

/// Arguments of `ferl plot`.
#[derive(Args, Debug)]
pub(crate) struct PlotArgs {
    /// A run folder (`trainer.default_local_dir`) or its `metrics.jsonl`.
    pub input: PathBuf,
    /// The metrics to draw, comma-separated (default: the run's losses, score, KL, entropy, learning rate and
    /// gradient norm that it logged).
    #[arg(long, value_delimiter = ',')]
    pub metrics: Option<Vec<String>>,
    /// The picture: a `.png`, or an `.svg` (default: `curves.png` in the current folder).
    #[arg(long, default_value = "curves.png")]
    pub out: PathBuf,
}

/// Draws the picture and says where it is.
pub(crate) fn run(a: PlotArgs) -> Result<()> {
    ferl_plot::plot(&a.input, a.metrics.as_deref(), &a.out)?;
    println!("wrote {}", a.out.display());
    Ok(())
}
