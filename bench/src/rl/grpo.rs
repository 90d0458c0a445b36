//! The GRPO rows: [`GrpoTrainer::step`] on the tiny Qwen2 (fp32, CPU), [`PROMPTS`] GSM8K prompts × [`N`] responses
//! of exactly [`NEW_TOKENS`] tokens (sampled at temperature 1, no stop token), one optimizer step per step (the whole
//! batch is one mini-batch), a KL loss to the initial weights (so the `ref` phase runs), and a trivial reward: the
//! share of the decoded response's characters that are ASCII digits (it varies between responses, so advantages are
//! not all zero). The first step is a warm-up; each `timing_s/*` is averaged over the `--grpo-steps` after it.

use super::{Prompt, RlArgs};
use crate::report::Report;
use anyhow::Result;
use ferl::trainer::data::SftTokenizer;
use ferl::trainer::engine::{Engine, EngineOptions};
use ferl::trainer::model::load_model;
use ferl::trainer::params::LocalParams;
use ferl::trainer::rl::{
    ActorLossConfig, FnReward, GrpoPrompt, GrpoSettings, GrpoTrainer, RewardRow,
};
use std::path::Path;
use tch::Kind;

/// Prompts per GRPO step.
pub(crate) const PROMPTS: usize = 8;
/// Responses per prompt (`rollout.n`).
const N: usize = 4;
/// Tokens per response (`max_response_length`; no stop token, so every response has this many).
const NEW_TOKENS: usize = 64;
/// verl's phases (`timing_s/<phase>`) and the rows they print as.
const PHASES: [(&str, &str); 8] = [
    ("gen", "grpo_step_gen_s"),
    ("reward", "grpo_step_reward_s"),
    ("old_log_prob", "grpo_step_old_log_prob_s"),
    ("ref", "grpo_step_ref_s"),
    ("adv", "grpo_step_adv_s"),
    ("update_actor", "grpo_step_update_actor_s"),
    ("update_weights", "grpo_step_update_weights_s"),
    ("step", "grpo_step_total_s"),
];

/// The run's settings: `n` 4, 64 tokens, one mini-batch of every prompt, micro-batches of 8 rows, a KL loss.
fn settings(pad_token_id: i64) -> GrpoSettings {
    GrpoSettings {
        n: N,
        temperature: 1.0,
        seed: 1,
        max_response_length: NEW_TOKENS,
        eos_token_ids: Vec::new(),
        pad_token_id,
        ppo_mini_batch_size: PROMPTS,
        ppo_micro_batch_size: 8,
        log_prob_micro_batch_size: 16,
        ref_log_prob_micro_batch_size: 16,
        loss: ActorLossConfig {
            use_kl_loss: true,
            ..ActorLossConfig::default()
        },
        ..GrpoSettings::default()
    }
}

/// A trainer of the model folder `model` with the digit-share reward and the tokenizer's decoding.
fn trainer(a: &RlArgs, model: &Path) -> Result<GrpoTrainer<LocalParams>> {
    let loaded = load_model(model)?;
    let store = LocalParams::new(loaded.layout, loaded.params, Kind::Float);
    let engine = Engine::new(loaded.config, store, Kind::Float, EngineOptions::default());
    let reward = FnReward::new("digit_share", |r: &RewardRow<'_>| {
        let chars = r.response.chars().count().max(1) as f64;
        r.response.chars().filter(char::is_ascii_digit).count() as f64 / chars
    });
    let tok = SftTokenizer::from_dir(&a.tokenizer, None)?;
    let mut t = GrpoTrainer::new(settings(tok.pad_token_id()), engine, Box::new(reward))?;
    t.set_decoder(Box::new(move |ids: &[i64]| {
        tok.decode(ids).unwrap_or_default()
    }));
    Ok(t)
}

/// Runs the warm-up step and `--grpo-steps` timed steps on `prompts` and prints each phase's mean seconds.
pub(crate) fn run(a: &RlArgs, model: &Path, prompts: &[Prompt], out: &mut Report) -> Result<()> {
    let mut t = trainer(a, model)?;
    let batch: Vec<GrpoPrompt> = prompts
        .iter()
        .map(|p| GrpoPrompt {
            ids: p.ids.clone(),
            ground_truth: p.ground_truth.clone(),
            ..GrpoPrompt::default()
        })
        .collect();
    let warm = t.step(&batch)?;
    eprintln!(
        "rl: GRPO: {PROMPTS} prompts x n {N} x {NEW_TOKENS} tokens; warm-up step {:.2} s",
        warm.metrics["timing_s/step"]
    );
    let mut sums = [0.0; PHASES.len()];
    for _ in 0..a.grpo_steps {
        let m = t.step(&batch)?.metrics;
        for (sum, (phase, _)) in sums.iter_mut().zip(PHASES) {
            *sum += m.get(&format!("timing_s/{phase}")).copied().unwrap_or(0.0);
        }
    }
    for (sum, (_, row)) in sums.iter().zip(PHASES) {
        out.row(row, sum / a.grpo_steps as f64, "s");
    }
    Ok(())
}
