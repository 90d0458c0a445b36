//! `ferl-bench rl`: the RL loop's costs on the CPU — generation throughput of ferl's rollout beside transformers, the
//! weight sync between processes beside the transport, and how one GRPO step's time splits over verl's phases.
//!
//! - [`generation`]: ferl's [`RolloutModel::generate`](ferl::trainer::rollout::RolloutModel::generate) beside
//!   transformers' `model.generate` (KV cache, fp32, greedy, exactly `--new-tokens` per prompt, no EOS stop) on the
//!   same random-init model folders, the same `--batch` GSM8K prompts (chat template, different lengths) and the same
//!   thread count, in one invocation; the peer is a child process (`rl/generation_peer.py`) in a private network
//!   namespace. Rows `gen_tokens_per_s_{ferl,transformers}_<model>`, `gen_speedup_vs_transformers_<model>` (goal ≥ 2)
//!   and `gen_greedy_tokens_equal_<model>` (how many of the batch's tokens the two greedy decodings share, position by
//!   position: the comparison is like for like when they agree). Beside them, what bounds any fp32 decoder here: the
//!   memory read bandwidth measured in the same run, the weights' bytes per decode step, ferl's prefill time, and
//!   from them `gen_ceiling_tokens_per_s_<model>` beside `gen_goal_tokens_per_s_<model>` (twice transformers); and
//!   [`products`]: one decode step's weight products, sgemm beside ferl's kernel.
//! - [`grpo`]: one [`GrpoTrainer::step`](ferl::rl::GrpoTrainer::step) of the tiny Qwen2, its `timing_s/*`
//!   averaged over `--grpo-steps` steps after a warm-up step, rows `grpo_step_<phase>_s` and `grpo_step_total_s`.
//!
//! Models (`--model tiny|0.5b|both`): `tiny` is the train suite's tiny Qwen2 (`tiny-qwen2`: hidden 128, 4 layers,
//! vocab 151,936), `0.5b` Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14 heads, 2 KV heads, intermediate 4864, vocab
//! 151,936, tied), both randomly initialised (seed 0, [`shape_config`]) and written in the Hugging Face layout with the
//! Qwen tokenizer.
//!
//! - [`sync`]: the weight sync between processes of each `--model` (the trainer's weights into a rollout running in
//!   another process): a `PolicyActor` and a `Rollout` actor on separate resource groups of an embedded cluster,
//!   timed by `ferl_actors::rl::sync_weights` (export into a shared-memory object, read, load), beside the
//!   transport alone moving the same bytes as one `SharedBytes` call. Rows `weight_sync_{bytes,s,GBps}_<model>`,
//!   `transport_GBps_same_payload_<model>` and `weight_sync_share_of_transport_<model>` (goal ≥ 0.5); it reuses the
//!   model folder the generation rows wrote. [`grpo`]'s `grpo_step_update_weights_s` is the colocated snapshot inside
//!   one process instead.
//!
//! - [`learn`] (`--learn`): time for `ferl grpo` (world 1 and 2) and TRL's `GRPOTrainer` to reach a mean reward of
//!   0.8 on the digit task.
//! - [`ranks`]: `ferl grpo` on the trainer ranks at world 1 and 2 (`--ranks-model tiny|0.5b`): step time, peak memory
//!   per rank and the colocated weight gather beside a memory-copy ceiling.
//!
//! `--no-gen` skips the generation rows, `--no-sync` the weight-sync rows, `--grpo-steps 0` the GRPO rows.

mod generation;
mod grpo;
mod learn;
mod products;
mod ranks;
mod sync;

use crate::report::Report;
use crate::train::shape_config;
use anyhow::{bail, Context, Result};
use clap::Args;
use ferl::trainer::data::gsm8k::INSTRUCTION;
use ferl::trainer::data::SftTokenizer;
use ferl::trainer::model::init_model;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Options of the rl suite.
#[derive(Args, Debug, Clone)]
pub(crate) struct RlArgs {
    /// Models of the generation and weight-sync rows: tiny (tiny-qwen2), 0.5b (Qwen2.5-0.5B's shape) or both.
    #[arg(long, default_value = "both")]
    model: String,
    /// Prompts per generation batch.
    #[arg(long, default_value_t = 16)]
    batch: usize,
    /// New tokens per prompt (every prompt gets exactly this many).
    #[arg(long, default_value_t = 128)]
    new_tokens: usize,
    /// Intra-op threads of both sides (default: every core).
    #[arg(long)]
    threads: Option<usize>,
    /// Timed generations per side and model (after a short warm-up generation).
    #[arg(long, default_value_t = 1)]
    repeats: usize,
    /// Timed GRPO steps (after a warm-up step); 0 skips the GRPO rows.
    #[arg(long, default_value_t = 2)]
    grpo_steps: usize,
    /// Timed weight syncs (and transport calls) per model, after a warm-up of each; their median is reported.
    #[arg(long, default_value_t = 3)]
    sync_repeats: usize,
    /// Skip the generation rows.
    #[arg(long)]
    no_gen: bool,
    /// Skip the weight-sync rows.
    #[arg(long)]
    no_sync: bool,
    /// The model of the trainer-rank rows (`ferl grpo` at world 1 and 2): tiny, 0.5b, or none to skip them.
    #[arg(long, default_value = "none")]
    ranks_model: String,
    /// Runs per world of the trainer-rank rows (their median, min and max are reported).
    #[arg(long, default_value_t = 3)]
    ranks_runs: usize,
    /// Race ferl (world 1 and 2) and TRL's GRPOTrainer to a mean reward of 0.8 on the digit task.
    #[arg(long)]
    learn: bool,
    /// Runs per side of the learning rows.
    #[arg(long, default_value_t = 3)]
    learn_runs: usize,
    /// Timed steps per run of the trainer-rank rows (after a warm-up step).
    #[arg(long, default_value_t = 2)]
    ranks_steps: usize,
    /// Tokenizer folder (copied into the models; renders the prompts).
    #[arg(long, default_value = "assets/tokenizers/qwen3")]
    tokenizer: PathBuf,
    /// GSM8K jsonl (question/answer columns) the prompts come from.
    #[arg(long, default_value = "assets/data/gsm8k/train.jsonl")]
    data: PathBuf,
}

impl RlArgs {
    /// The thread count of both sides: `--threads`, else every core.
    pub(crate) fn threads(&self) -> usize {
        self.threads.unwrap_or_else(|| {
            std::thread::available_parallelism()
                .map(usize::from)
                .unwrap_or(1)
        })
    }
}

/// One prompt of the suite: its chat-rendered token ids and the GSM8K answer.
pub(crate) struct Prompt {
    /// Token ids of the question rendered through the tokenizer's chat template (generation prompt added).
    pub(crate) ids: Vec<i64>,
    /// The final answer after `####`.
    pub(crate) ground_truth: String,
}

/// Runs the suite: generation and weight-sync rows for each `--model`, then the GRPO step split.
pub(crate) fn run(a: RlArgs, out: &mut Report) -> Result<()> {
    let models: &[&str] = match a.model.as_str() {
        "tiny" => &["tiny"],
        "0.5b" => &["0.5b"],
        "both" => &["tiny", "0.5b"],
        other => bail!("--model {other}: expected tiny, 0.5b or both"),
    };
    if !["none", "tiny", "0.5b"].contains(&a.ranks_model.as_str()) {
        bail!(
            "--ranks-model {}: expected tiny, 0.5b or none",
            a.ranks_model
        );
    }
    if a.batch == 0 || a.new_tokens == 0 || a.repeats == 0 || a.sync_repeats == 0 {
        bail!("--batch, --new-tokens, --repeats and --sync-repeats must be positive");
    }
    let threads = a.threads();
    tch::set_num_threads(threads as i32);
    eprintln!(
        "rl: {threads} threads, batch {} x {} new tokens, {} timed repeat(s)",
        a.batch, a.new_tokens, a.repeats
    );
    let dir = std::env::temp_dir().join(format!("ferl-bench-rl-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let result = measure(&a, models, &dir, out);
    let _ = std::fs::remove_dir_all(&dir);
    result
}

/// The generation and weight-sync rows of `models` (one model folder each), then the GRPO rows, in the scratch
/// folder `dir`.
fn measure(a: &RlArgs, models: &[&str], dir: &Path, out: &mut Report) -> Result<()> {
    let prompts = gsm8k_prompts(a, a.batch.max(grpo::PROMPTS))?;
    for &name in models.iter().filter(|_| !(a.no_gen && a.no_sync)) {
        let started = Instant::now();
        let model = write_model(a, name, dir)?;
        eprintln!(
            "rl: {name}: model written in {:.1} s",
            started.elapsed().as_secs_f64()
        );
        if !a.no_gen {
            generation::run(a, name, &model, &prompts[..a.batch], out)?;
            eprintln!(
                "rl: {name}: {:.1} s (model init, both sides' loading, warm-up and generation)",
                started.elapsed().as_secs_f64()
            );
        }
        if !a.no_sync {
            sync::run(a, name, &model, out)?;
        }
        std::fs::remove_dir_all(&model)?;
    }
    if a.learn {
        learn::run(a, dir, out)?;
    }
    if a.ranks_model != "none" {
        let model = write_model(a, &a.ranks_model, dir)?;
        ranks::run(a, &a.ranks_model, &model, dir, out)?;
        std::fs::remove_dir_all(&model)?;
    }
    if a.grpo_steps > 0 {
        let started = Instant::now();
        let model = write_model(a, "tiny", dir)?;
        grpo::run(a, &model, &prompts[..grpo::PROMPTS], out)?;
        eprintln!(
            "rl: GRPO: {:.1} s ({} steps)",
            started.elapsed().as_secs_f64(),
            a.grpo_steps + 1
        );
    }
    Ok(())
}

/// Writes the random-init model `name` (`tiny` or `0.5b`, seed 0, with the tokenizer) to `dir/<name>`.
fn write_model(a: &RlArgs, name: &str, dir: &Path) -> Result<PathBuf> {
    let shape = match name {
        "tiny" => "tiny-qwen2",
        _ => "qwen2.5-0.5b",
    };
    let config = dir.join(format!("{name}.json"));
    std::fs::write(&config, shape_config(shape)?.to_string())?;
    let model = dir.join(name);
    init_model(&config, Some(&a.tokenizer), &model, 0)
        .with_context(|| format!("writing the {shape} model"))?;
    Ok(model)
}

/// The first `count` GSM8K questions (with verl's instruction) as chat prompts, and their answers.
fn gsm8k_prompts(a: &RlArgs, count: usize) -> Result<Vec<Prompt>> {
    let tok = SftTokenizer::from_dir(&a.tokenizer, None)?;
    let text = std::fs::read_to_string(&a.data)
        .with_context(|| format!("reading {}", a.data.display()))?;
    let prompts = text
        .lines()
        .take(count)
        .map(|line| {
            let row: serde_json::Value = serde_json::from_str(line)?;
            let question = row["question"].as_str().context("a row without question")?;
            let answer = row["answer"].as_str().unwrap_or_default();
            let message =
                serde_json::json!({"role": "user", "content": format!("{question} {INSTRUCTION}")});
            let rendered = tok
                .template()?
                .render(&[message], true, None, &BTreeMap::new())?;
            Ok(Prompt {
                ids: tok.encode(&rendered)?,
                ground_truth: ferl::trainer::data::gsm8k::extract_solution(answer)
                    .unwrap_or_default(),
            })
        })
        .collect::<Result<Vec<_>>>()?;
    if prompts.len() < count {
        bail!(
            "{}: {} rows, the suite needs {count}",
            a.data.display(),
            prompts.len()
        );
    }
    Ok(prompts)
}

/// The median of `v` (the mean of the two middle values for an even count).
fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let mid = v.len() / 2;
    match v.len() % 2 {
        0 => (v[mid - 1] + v[mid]) / 2.0,
        _ => v[mid],
    }
}
