//! `ferl-bench train --sequence-parallel K [--seq-len T] [--steps S] [--device cpu|cuda] [--dtype bf16|fp32]`: peak
//! memory per rank of Ulysses sequence parallelism (issue #13's goal: at `T = 4096` on the tiny model, SP 2 ≤ 0.6× one
//! rank).
//!
//! Three groups of ferl trainer ranks (the `--nproc-per-node` benchmark's rank processes: FULL_SHARD, one thread
//! each, remove-padding on; on the CPU fp32 over the TCP collective, on CUDA `--dtype` compute over NCCL with one GPU
//! per rank, so `K` GPUs) train the same `T`-token synthetic sequences (random ids, loss on the second half), one
//! sequence per data-parallel rank per step:
//! - `sp1_w1`: one rank holding whole sequences;
//! - `dp_wK`: `K` ranks of data parallelism, each holding whole sequences (`K` of them per step);
//! - `sp_wK`: `K` ranks sharing each sequence (`ulysses_sequence_parallel_size=K`), each holding `1/K` of it.
//!
//! `dp_wK` and `sp_wK` shard the parameters alike, so their difference is the sequence's share alone; `sp1_w1` is
//! what the issue compares against. Rows: `sp_<group>_tokens_per_s` and the largest rank's peak, then the peaks'
//! ratios: on the CPU the resident set (`VmHWM`), `sp_<group>_peak_rss_MiB`, `sp_peak_rss_vs_one_rank`,
//! `sp_peak_rss_vs_dp`; on CUDA the device's memory in use (`perf/max_memory_gb`'s figure, the CUDA context
//! included), `sp_<group>_peak_device_MiB`, `sp_peak_device_vs_one_rank`, `sp_peak_device_vs_dp`.

use super::common::{group_figures, prepare};
use super::fsdp::run_ranks;
use super::TrainArgs;
use crate::report::Report;
use anyhow::{bail, Result};
use rand::{Rng, SeedableRng};

/// Runs the three groups and prints the rows.
pub(super) fn run(a: &TrainArgs, k: usize, out: &mut Report) -> Result<()> {
    if k < 2 || a.steps < 2 {
        bail!("--sequence-parallel needs at least 2 ranks and --steps at least 2");
    }
    let dir = std::env::temp_dir().join(format!("ferl-bench-sp-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let result = measure(a, k, &dir, out);
    let _ = std::fs::remove_dir_all(&dir);
    result
}

fn measure(a: &TrainArgs, k: usize, dir: &std::path::Path, out: &mut Report) -> Result<()> {
    let groups = [
        ("sp1_w1", 1, None, 1),
        ("dp_wK", k, None, k),
        ("sp_wK", k, Some(k), 1),
    ];
    let device = a.device.as_deref().unwrap_or("cpu");
    let peak = match device {
        "cuda" => "peak_device",
        _ => "peak_rss",
    };
    let mut peaks = Vec::new();
    for (name, world, sp, per_step) in groups {
        let args = TrainArgs {
            batch: per_step,
            micro_batch: 1,
            ..a.clone()
        };
        prepare(&args, dir)?;
        write_sequences(&args, dir)?;
        let ranks = run_ranks(&args, dir, world, 1, sp, device)?;
        let (rate, mib) = group_figures(&ranks);
        let name = name.replace('K', &k.to_string());
        out.row(&format!("sp_{name}_tokens_per_s"), rate, "tokens/s");
        out.row(&format!("sp_{name}_{peak}_MiB"), mib, "MiB");
        peaks.push(mib);
    }
    out.row(&format!("sp_{peak}_vs_one_rank"), peaks[2] / peaks[0], "x");
    out.row(&format!("sp_{peak}_vs_dp"), peaks[2] / peaks[1], "x");
    Ok(())
}

/// Replaces `dir/data.json` with `batch * steps` sequences of `--seq-len` random tokens, the second half targets.
fn write_sequences(a: &TrainArgs, dir: &std::path::Path) -> Result<()> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(0);
    let rows: Vec<serde_json::Value> = (0..a.batch * a.steps)
        .map(|_| {
            let ids: Vec<i64> = (0..a.seq_len)
                .map(|_| rng.random_range(0..100_000))
                .collect();
            let mask: Vec<bool> = (0..a.seq_len).map(|t| t >= a.seq_len / 2).collect();
            serde_json::json!({"input_ids": ids, "loss_mask": mask})
        })
        .collect();
    std::fs::write(dir.join("data.json"), serde_json::to_string(&rows)?)?;
    Ok(())
}
