//! The GRPO rows: [`GrpoTrainer::step`] on the tiny Qwen2 (fp32, CPU), [`PROMPTS`] GSM8K prompts × [`N`] responses
//! of exactly [`NEW_TOKENS`] tokens (sampled at temperature 1, no stop token), one optimizer step per step (the whole
//! batch is one mini-batch), a KL loss to the initial weights (so the `ref` phase runs), and a trivial reward: the
//! share of the decoded response's characters that are ASCII digits (it varies between responses, so advantages are
//! not all zero). The first step is a warm-up; each `timing_s/*` is averaged over the `--grpo-steps` after it.
//!
//! Then the last step's batch is updated again [`UPDATE_ROUNDS`] times with micro-batches of [`MICRO`] rows and as
//! one micro-batch, alternating (the update's cost does not depend on the weights' values): the medians give the
//! fixed cost of a micro-batch (`grpo_micro_batch_fixed_ms`) and its share of a micro-batch's compute
//! (`grpo_micro_batch_fixed_share`).

use super::{median, Prompt, RlArgs};
use crate::report::Report;
use anyhow::Result;
use ferl::rl::{
    ActorLossConfig, ActorUpdateConfig, FnReward, GrpoPrompt, GrpoSettings, GrpoTrainer,
    MicroBatching, RewardRow, RlBatch,
};
use ferl::trainer::data::SftTokenizer;
use ferl::trainer::engine::{Engine, EngineOptions};
use ferl::trainer::model::load_model;
use ferl::trainer::params::LocalParams;
use std::path::Path;
use std::time::Instant;
use tch::Kind;

/// Prompts per GRPO step.
pub(crate) const PROMPTS: usize = 8;
/// Responses per prompt (`rollout.n`).
const N: usize = 4;
/// Tokens per response (`max_response_length`; no stop token, so every response has this many).
const NEW_TOKENS: usize = 64;
/// Rows per micro-batch of the update (`ppo_micro_batch_size_per_gpu`) in the main rows.
const MICRO: usize = 8;
/// Timed updates per micro-batch size in the micro-batch rows.
const UPDATE_ROUNDS: usize = 5;
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

/// The run's settings: `n` 4, 64 tokens, one mini-batch of every prompt, micro-batches of `micro` rows, a KL loss.
fn settings(pad_token_id: i64, micro: usize) -> GrpoSettings {
    GrpoSettings {
        n: N,
        temperature: 1.0,
        seed: 1,
        max_response_length: NEW_TOKENS,
        eos_token_ids: Vec::new(),
        pad_token_id,
        ppo_mini_batch_size: PROMPTS,
        ppo_micro_batching: MicroBatching::Rows(micro),
        log_prob_micro_batching: MicroBatching::Rows(16),
        ref_log_prob_micro_batching: MicroBatching::Rows(16),
        loss: ActorLossConfig {
            use_kl_loss: true,
            ..ActorLossConfig::default()
        },
        ..GrpoSettings::default()
    }
}

/// A trainer of the model folder `model` with the digit-share reward and the tokenizer's decoding, its update in
/// micro-batches of `micro` rows.
fn trainer(a: &RlArgs, model: &Path, micro: usize) -> Result<GrpoTrainer<LocalParams>> {
    let loaded = load_model(model)?;
    let store = LocalParams::new(loaded.layout, loaded.params, Kind::Float);
    let engine = Engine::new(loaded.config, store, Kind::Float, EngineOptions::default());
    let reward = FnReward::new("digit_share", |r: &RewardRow<'_>| {
        let chars = r.response.chars().count().max(1) as f64;
        r.response.chars().filter(char::is_ascii_digit).count() as f64 / chars
    });
    let tok = SftTokenizer::from_dir(&a.tokenizer, None)?;
    let mut t = GrpoTrainer::new(
        settings(tok.pad_token_id(), micro),
        engine,
        Box::new(reward),
    )?;
    t.set_decoder(Box::new(move |ids: &[i64]| {
        tok.decode(ids).unwrap_or_default()
    }));
    Ok(t)
}

/// Runs the warm-up step and `--grpo-steps` timed steps on `prompts` and prints each phase's mean seconds; then
/// the micro-batch rows (see the module docs).
pub(crate) fn run(a: &RlArgs, model: &Path, prompts: &[Prompt], out: &mut Report) -> Result<()> {
    let batch: Vec<GrpoPrompt> = prompts
        .iter()
        .map(|p| GrpoPrompt {
            ids: p.ids.clone(),
            ground_truth: p.ground_truth.clone(),
            ..GrpoPrompt::default()
        })
        .collect();
    let mut t = trainer(a, model, MICRO)?;
    let warm = t.step(&batch)?;
    eprintln!(
        "rl: GRPO: {PROMPTS} prompts x n {N} x {NEW_TOKENS} tokens; warm-up step {:.2} s",
        warm.metrics["timing_s/step"]
    );
    let mut sums = [0.0; PHASES.len()];
    let mut last = warm.batch;
    for _ in 0..a.grpo_steps {
        let step = t.step(&batch)?;
        for (sum, (phase, _)) in sums.iter_mut().zip(PHASES) {
            *sum += step
                .metrics
                .get(&format!("timing_s/{phase}"))
                .copied()
                .unwrap_or(0.0);
        }
        last = step.batch;
    }
    for (sum, (_, row)) in sums.iter().zip(PHASES) {
        out.row(row, sum / a.grpo_steps as f64, "s");
    }
    micro_batch_rows(&mut t, &last, out)
}

/// The update of `batch` with micro-batches of [`MICRO`] rows against one micro-batch (see the module docs).
fn micro_batch_rows(
    t: &mut GrpoTrainer<LocalParams>,
    batch: &RlBatch,
    out: &mut Report,
) -> Result<()> {
    let s = t.settings().clone();
    let rows = batch.len();
    let cfg = |micro: usize| ActorUpdateConfig {
        micro_batching: MicroBatching::Rows(micro),
        ..s.update_config(0)
    };
    let (mut split, mut whole) = (Vec::new(), Vec::new());
    for _ in 0..UPDATE_ROUNDS {
        for (micro, times) in [(MICRO, &mut split), (rows, &mut whole)] {
            let started = Instant::now();
            t.actor_mut().update_policy(batch, &cfg(micro))?;
            times.push(started.elapsed().as_secs_f64());
        }
    }
    let (split, whole) = (median(split), median(whole));
    let micro_batches = rows.div_ceil(MICRO);
    let fixed = (split - whole) / (micro_batches - 1) as f64;
    out.row(&format!("grpo_update_actor_s_micro{MICRO}"), split, "s");
    out.row(&format!("grpo_update_actor_s_micro{rows}"), whole, "s");
    out.row("grpo_micro_batch_fixed_ms", fixed * 1e3, "ms");
    out.row(
        "grpo_micro_batch_fixed_share",
        fixed / (whole / micro_batches as f64),
        "x",
    );
    Ok(())
}
