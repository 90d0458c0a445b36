//! verl's rollout dumps (`trainer.rollout_data_dir`): after each step, `{dir}/{step}.jsonl` holds one line per row
//! of the step's batch — `input` (the prompt) and `output` (the response), both decoded as the reward sees them
//! (special tokens skipped), `gts` (the ground truth), `score` (the reward) and `step` — in the batch's order
//! (`rollout.n` responses of each prompt together), as verl's `_dump_generations` writes them. The file is written
//! whole or not at all (a temporary file renamed into place).

use std::path::Path;

use anyhow::{Context as _, Result};
use ferl_rl::{GrpoStep, RlBatch};
use serde_json::json;

/// Writes step `step`'s rows of `batch` (scored) into `dir/{step}.jsonl`, decoding prompts with `decoder`'s (the step's) decoder.
pub fn dump_generations(dir: &Path, step: u64, batch: &RlBatch, decoder: &GrpoStep) -> Result<()> {
    let scores = batch
        .rewards
        .as_ref()
        .context("rollout dump: the batch has no scores")?;
    let mut text = String::new();
    for (row, score) in batch.rows.iter().zip(scores) {
        let line = json!({
            "input": decoder.decode(&row.prompt),
            "output": row.response_text,
            "gts": row.ground_truth,
            "score": score,
            "step": step,
        });
        text.push_str(&line.to_string());
        text.push('\n');
    }
    std::fs::create_dir_all(dir)
        .with_context(|| format!("trainer.rollout_data_dir: creating {}", dir.display()))?;
    let file = dir.join(format!("{step}.jsonl"));
    ferl_trainer::checkpoint::write_atomic(&file, text.as_bytes())
        .with_context(|| format!("trainer.rollout_data_dir: writing {}", file.display()))
}
