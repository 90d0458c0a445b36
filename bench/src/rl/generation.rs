//! The generation rows: ferl's batched greedy generation in this process, then transformers' in a child process
//! (`generation_peer.py`), on the same model folder, prompts and threads; each side warms up with a short generation
//! ([`WARMUP_TOKENS`] tokens of the first two prompts) and times only its `--repeats` generations (model loading is
//! not timed). Tokens/s = batch × new tokens × repeats ÷ the repeats' wall time (prefill included).
//!
//! Beside them, the rate no fp32 decoder can pass on this machine, measured in the same run ([`Ceiling`]): each
//! decode step reads every weight once (the tied `[V, H]` matrix as the head), so a step takes at least the weights'
//! bytes ÷ the memory read bandwidth of these threads (a sum over 1 GiB). With ferl's own prefill time (a generation
//! of one new token) added, `gen_ceiling_tokens_per_s_<model>` = batch × new tokens ÷ (prefill + (new tokens − 1) ×
//! that step); `gen_goal_tokens_per_s_<model>` is twice transformers' rate. Where the goal is above the ceiling, no
//! fp32 kernel work reaches it here.

use super::{Prompt, RlArgs};
use crate::report::Report;
use crate::train::python;
use anyhow::{bail, Context, Result};
use ferl::trainer::model::config::ModelConfig;
use ferl::trainer::model::layout::ModelLayout;
use ferl::trainer::rollout::{GenerationConfig, RolloutModel, SamplingParams};
use std::path::Path;
use std::process::Command;
use std::time::Instant;
use tch::{Device, Kind};

/// New tokens of each side's untimed warm-up generation, of the first two prompts (the peer's `WARMUP_TOKENS` too).
const WARMUP_TOKENS: usize = 8;
/// The speedup over transformers the rollout aims at.
const GOAL: f64 = 2.0;

/// One side's timed generations: seconds of each repeat and the last repeat's new tokens per prompt.
struct GenRecord {
    /// Wall seconds of each timed generation.
    gen_s: Vec<f64>,
    /// The new tokens of each prompt (last repeat).
    tokens: Vec<Vec<i64>>,
}

/// What bounds ferl's decoding from above on this machine (see the module docs).
struct Ceiling {
    /// Seconds of a generation of one new token for the whole batch (its prefill, and one step).
    prefill_s: f64,
    /// Bytes of the fp32 weights one decode step reads.
    weight_bytes: f64,
    /// The model's shapes.
    cfg: ModelConfig,
}

impl GenRecord {
    /// New tokens per second over the timed repeats; refuses a record that did not generate exactly `new_tokens` per
    /// prompt for `batch` prompts.
    fn tokens_per_s(&self, side: &str, batch: usize, new_tokens: usize) -> Result<f64> {
        if self.tokens.len() != batch || self.tokens.iter().any(|t| t.len() != new_tokens) {
            bail!("{side} did not generate {new_tokens} tokens for each of {batch} prompts");
        }
        let total = (batch * new_tokens * self.gen_s.len()) as f64;
        Ok(total / self.gen_s.iter().sum::<f64>())
    }
}

/// Measures both sides on the model folder `model` (`name`: tiny or 0.5b) and prints the rows.
pub(crate) fn run(
    a: &RlArgs,
    name: &str,
    model: &Path,
    prompts: &[Prompt],
    out: &mut Report,
) -> Result<()> {
    let ids: Vec<Vec<i64>> = prompts.iter().map(|p| p.ids.clone()).collect();
    let lens: Vec<usize> = ids.iter().map(Vec::len).collect();
    eprintln!(
        "rl: {name}: prompts of {} to {} tokens",
        lens.iter().min().unwrap_or(&0),
        lens.iter().max().unwrap_or(&0)
    );
    let (ferl, ceiling) = ferl_side(a, model, &ids)?;
    let prompts_file = model.join("bench_prompts.json");
    std::fs::write(&prompts_file, serde_json::to_string(&ids)?)?;
    let peer = peer_side(a, model, &prompts_file)?;
    let ferl_rate = ferl.tokens_per_s("ferl", a.batch, a.new_tokens)?;
    let peer_rate = peer.tokens_per_s("transformers", a.batch, a.new_tokens)?;
    let speedup = ferl_rate / peer_rate;
    eprintln!(
        "rl: {name}: timed generation {:.1} s (ferl), {:.1} s (transformers)",
        ferl.gen_s.iter().sum::<f64>(),
        peer.gen_s.iter().sum::<f64>()
    );
    out.row(
        &format!("gen_tokens_per_s_ferl_{name}"),
        ferl_rate,
        "tokens/s",
    );
    out.row(
        &format!("gen_tokens_per_s_transformers_{name}"),
        peer_rate,
        "tokens/s",
    );
    out.row(&format!("gen_speedup_vs_transformers_{name}"), speedup, "x");
    ceiling_rows(a, name, &ceiling, peer_rate, out);
    super::products::run(name, &ceiling.cfg, a.batch as i64, out);
    let met = if speedup >= GOAL { "met" } else { "not met" };
    eprintln!("rl: {name}: speedup {speedup:.2}x, goal >= {GOAL}x: {met}");
    let equal = agreement(name, &ferl.tokens, &peer.tokens);
    out.row(
        &format!("gen_greedy_tokens_equal_{name}"),
        equal as f64,
        "tokens",
    );
    Ok(())
}

/// Prints the ceiling rows beside the goal (`peer_rate`: transformers' tokens/s).
fn ceiling_rows(a: &RlArgs, name: &str, c: &Ceiling, peer_rate: f64, out: &mut Report) {
    let bandwidth = memory_read_bytes_per_s();
    let step_s = c.weight_bytes / bandwidth;
    let floor_s = c.prefill_s + a.new_tokens.saturating_sub(1) as f64 * step_s;
    let ceiling = (a.batch * a.new_tokens) as f64 / floor_s;
    out.row(
        &format!("gen_memory_read_GBps_{name}"),
        bandwidth / 1e9,
        "GB/s",
    );
    out.row(
        &format!("gen_weight_MB_per_step_{name}"),
        c.weight_bytes / 1e6,
        "MB",
    );
    out.row(&format!("gen_prefill_s_{name}"), c.prefill_s, "s");
    out.row(
        &format!("gen_ceiling_tokens_per_s_{name}"),
        ceiling,
        "tokens/s",
    );
    out.row(
        &format!("gen_goal_tokens_per_s_{name}"),
        GOAL * peer_rate,
        "tokens/s",
    );
}

/// This process's memory read bandwidth on its intra-op threads: the best of three sums over 1 GiB of fp32.
fn memory_read_bytes_per_s() -> f64 {
    let x = tch::Tensor::ones([1 << 28], (Kind::Float, Device::Cpu));
    let _ = x.sum(Kind::Float); // faults the pages in
    let best = (0..3)
        .map(|_| {
            let started = Instant::now();
            let _ = x.sum(Kind::Float).double_value(&[]);
            started.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min);
    (x.numel() * 4) as f64 / best
}

/// ferl's side, in this process: loads the folder, warms up, times a one-token generation (the [`Ceiling`]'s
/// prefill), then `--repeats` greedy generations without a stop token (so exactly `--new-tokens` each).
fn ferl_side(a: &RlArgs, model: &Path, prompts: &[Vec<i64>]) -> Result<(GenRecord, Ceiling)> {
    let rollout = RolloutModel::load(model, Device::Cpu, Kind::Float)?;
    let config = |n| GenerationConfig::new(n, SamplingParams::default());
    rollout.generate(&prompts[..prompts.len().min(2)], &config(WARMUP_TOKENS))?;
    let started = Instant::now();
    rollout.generate(prompts, &config(1))?;
    let ceiling = Ceiling {
        prefill_s: started.elapsed().as_secs_f64(),
        weight_bytes: (ModelLayout::new(rollout.config()).num_params() * 4) as f64,
        cfg: rollout.config().clone(),
    };
    let (mut gen_s, mut tokens) = (Vec::new(), Vec::new());
    for _ in 0..a.repeats {
        let started = Instant::now();
        let generated = rollout.generate(prompts, &config(a.new_tokens))?;
        gen_s.push(started.elapsed().as_secs_f64());
        tokens = generated.into_iter().map(|g| g.response).collect();
    }
    Ok((GenRecord { gen_s, tokens }, ceiling))
}

/// The transformers peer (`generation_peer.py`) on the same folder and prompts, in a private network namespace.
fn peer_side(a: &RlArgs, model: &Path, prompts: &Path) -> Result<GenRecord> {
    let record = model.join("bench_peer.json");
    let threads = a.threads().to_string();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/rl/generation_peer.py");
    let result = isolated(&python())
        .arg(script)
        .arg("--model")
        .arg(model)
        .arg("--prompts")
        .arg(prompts)
        .args(["--new-tokens", &a.new_tokens.to_string()])
        .args(["--threads", &threads])
        .args(["--repeats", &a.repeats.to_string()])
        .arg("--out")
        .arg(&record)
        .env("OMP_NUM_THREADS", &threads)
        .env("HF_HUB_OFFLINE", "1")
        .env("TRANSFORMERS_OFFLINE", "1")
        .output()
        .context("starting the transformers peer")?;
    if !result.status.success() {
        bail!(
            "the transformers peer failed ({}); is the venv set up (scripts/setup.sh)?\n{}",
            result.status,
            String::from_utf8_lossy(&result.stderr)
        );
    }
    let v: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(&record)
            .with_context(|| format!("reading {}", record.display()))?,
    )?;
    eprintln!("rl: peer {}", v["peer"].as_str().unwrap_or("?"));
    let gen_s = v["gen_s"]
        .as_array()
        .map(|x| x.iter().filter_map(|s| s.as_f64()).collect())
        .unwrap_or_default();
    let tokens = serde_json::from_value(v["tokens"].clone()).context("the peer's tokens")?;
    Ok(GenRecord { gen_s, tokens })
}

/// A command running `program` in a private network namespace (`unshare -n`: no network at all), or, with a note,
/// directly where no namespace can be made (the peer is offline by `HF_HUB_OFFLINE` either way).
fn isolated(program: &Path) -> Command {
    let private = Command::new("unshare")
        .args(["-n", "true"])
        .output()
        .is_ok_and(|o| o.status.success());
    if private {
        let mut cmd = Command::new("unshare");
        cmd.arg("-n").arg(program);
        return cmd;
    }
    eprintln!("rl: no network namespace could be made (unshare -n); the transformers peer runs in this one");
    Command::new(program)
}

/// Counts the positions where ferl's and transformers' greedy tokens are equal and prints the agreement: equal
/// tokens, identical sequences, and the shortest common prefix.
fn agreement(name: &str, ferl: &[Vec<i64>], peer: &[Vec<i64>]) -> usize {
    let total: usize = ferl.iter().map(Vec::len).sum();
    let equal: usize = ferl
        .iter()
        .zip(peer)
        .map(|(x, y)| x.iter().zip(y).filter(|(p, q)| p == q).count())
        .sum();
    let prefixes: Vec<usize> = ferl
        .iter()
        .zip(peer)
        .map(|(x, y)| x.iter().zip(y).take_while(|(p, q)| p == q).count())
        .collect();
    let identical = ferl.iter().zip(peer).filter(|(x, y)| x == y).count();
    eprintln!(
        "rl: {name}: greedy tokens equal {equal} of {total}; {identical} of {} sequences identical; shortest common \
         prefix {} tokens",
        ferl.len(),
        prefixes.iter().min().unwrap_or(&0)
    );
    equal
}
