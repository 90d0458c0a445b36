//! `ferl-bench train --nproc-per-node N`: sharded training of the tiny Qwen2 at world size 1 and N, ferl's FULL_SHARD
//! ranks beside PyTorch FSDP2 (`fully_shard` per decoder layer and on the root, gloo), on the same model, global
//! batches, micro-batch size, loop settings and threads per rank.
//!
//! - ferl: N processes of this binary started the way an external launcher starts ranks (`RANK`, `WORLD_SIZE`,
//!   `MASTER_ADDR`, `MASTER_PORT`, the store hosted here), each a [`RankState`] — the trainer rank of `ferl sft`:
//!   `ferl-fsdp`'s `ShardedParams` (FULL_SHARD from `model.fsdp_config`) over the TCP collective, the config's
//!   optimizer — training its contiguous share of every global batch.
//! - PyTorch: `trainer/py/fsdp2_reference.py` under `unshare -n` (private loopback), N ranks.
//!
//! Every rank times each step between two barriers; a group's tokens/s is the global batch's real tokens of the timed
//! steps (all but the first) over the slowest rank's time, its peak memory the largest rank's peak resident set
//! (`VmHWM`, from `ferl_actors::device_memory::peak_resident_bytes` — the figure CPU trainer ranks report
//! as `perf/max_memory_gb/rank_R`). Rows, for W in {1, N}: `fsdp_wW_{ferl,pytorch}_tokens_per_s`,
//! `fsdp_wW_{ferl,pytorch}_peak_rss_MiB`, `fsdp_wW_first_loss_rel_diff_ppm` (the two sides train the same thing),
//! then the ratios `fsdp_wW_tokens_per_s_ratio` (ferl ÷ PyTorch, goal ≥ 1.2) and `fsdp_wW_peak_rss_ratio` (goal ≤ 1),
//! and `fsdp_wW_{ferl,pytorch}_cpu_mfu[_6n]` over `fsdp_wW_gemm_peak_GFLOPs`, the sum of the GEMM peaks ferl's ranks
//! measured at the same moment on their threads (`super::mfu`).

use super::common::{group_figures, prepare, py_script, python, read_samples, SideRecord};
use super::TrainArgs;
use crate::report::Report;
use anyhow::{bail, Context, Result};
use ferl::actors::rank::RankState;
use ferl::trainer::config::SftConfig;
use ferl::trainer::data::rank_shard;
use ferl_collective::{init_groups_from_env, TcpStoreServer};
use std::path::Path;
use std::process::Command;
use std::time::Instant;
use tch::Device;

/// Measures both sides at world size 1 and `world`, then prints the rows.
pub(super) fn run(a: &TrainArgs, world: usize, dir: &Path, out: &mut Report) -> Result<()> {
    if world == 0 || !a.batch.is_multiple_of(world) {
        bail!(
            "--nproc-per-node {world}: --batch {} must be a positive multiple of it",
            a.batch
        );
    }
    prepare(a, dir)?;
    let threads = a.threads.unwrap_or(1);
    let mut sizes = vec![1];
    if world > 1 {
        sizes.push(world);
    }
    let mut rows = Vec::new();
    for &w in &sizes {
        let ferl = run_ferl(a, dir, w, threads)?;
        if a.skip_pytorch {
            let (rate, mib) = group_figures(&ferl);
            out.row(&format!("fsdp_w{w}_ferl_tokens_per_s"), rate, "tokens/s");
            out.row(&format!("fsdp_w{w}_ferl_peak_rss_MiB"), mib, "MiB");
            super::mfu_rows(a, dir, &format!("fsdp_w{w}"), &ferl, &[], out)?;
            continue;
        }
        let torch = run_pytorch(dir, w, threads)?;
        rows.push((w, ferl, torch));
    }
    for (w, ferl, torch) in &rows {
        let (fr, fm) = group_figures(ferl);
        let (tr, tm) = group_figures(torch);
        out.row(&format!("fsdp_w{w}_ferl_tokens_per_s"), fr, "tokens/s");
        out.row(&format!("fsdp_w{w}_pytorch_tokens_per_s"), tr, "tokens/s");
        out.row(&format!("fsdp_w{w}_ferl_peak_rss_MiB"), fm, "MiB");
        out.row(&format!("fsdp_w{w}_pytorch_peak_rss_MiB"), tm, "MiB");
        if let (Some(fl), Some(tl)) = (ferl[0].loss.first(), torch[0].loss.first()) {
            out.row(
                &format!("fsdp_w{w}_first_loss_rel_diff_ppm"),
                (fl - tl).abs() / tl.abs().max(1e-12) * 1e6,
                "ppm",
            );
        }
    }
    for (w, ferl, torch) in &rows {
        let (fr, fm) = group_figures(ferl);
        let (tr, tm) = group_figures(torch);
        out.row(&format!("fsdp_w{w}_tokens_per_s_ratio"), fr / tr, "x");
        out.row(&format!("fsdp_w{w}_peak_rss_ratio"), fm / tm, "x");
        super::mfu_rows(a, dir, &format!("fsdp_w{w}"), ferl, torch, out)?;
    }
    Ok(())
}

/// Starts `world` ferl ranks (this binary, launcher environment) and reads their records.
fn run_ferl(a: &TrainArgs, dir: &Path, world: usize, threads: usize) -> Result<Vec<SideRecord>> {
    run_ranks(a, dir, world, threads, None, "cpu")
}

/// [`run_ferl`], with `sp` the ranks' `ulysses_sequence_parallel_size` (and remove-padding) when given, on `device`
/// (`cpu`, or `cuda`: rank `r` sees only GPU `r`, through `CUDA_VISIBLE_DEVICES`, and the group talks over NCCL).
pub(super) fn run_ranks(
    a: &TrainArgs,
    dir: &Path,
    world: usize,
    threads: usize,
    sp: Option<usize>,
    device: &str,
) -> Result<Vec<SideRecord>> {
    let out = dir.join(format!("ferl_w{world}"));
    std::fs::create_dir_all(&out)?;
    let secret = ferl_collective::JobSecret::generate()?;
    let store = TcpStoreServer::bind("127.0.0.1:0", secret.clone())?;
    let exe = std::env::current_exe()?;
    let mut children = Vec::new();
    for rank in 0..world {
        let mut cmd = Command::new(&exe);
        cmd.args(["train", "--rank-child"])
            .arg(dir)
            .args(["--threads", &threads.to_string()])
            .args(["--batch", &a.batch.to_string()])
            .args(["--micro-batch", &a.micro_batch.to_string()])
            .args(["--steps", &a.steps.to_string()])
            .env("RANK", rank.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("WORLD_SIZE", world.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env(ferl_collective::JOB_SECRET_ENV, secret.to_hex())
            .env("MASTER_PORT", store.local_addr().port().to_string())
            .env("FERL_STORE_HOSTED", "1")
            .env("OMP_NUM_THREADS", threads.to_string());
        if a.gradient_checkpointing {
            cmd.arg("--gradient-checkpointing");
        }
        if let Some(k) = sp {
            cmd.args(["--rank-sp", &k.to_string()]);
        }
        cmd.args(["--device", device, "--dtype", &a.dtype]);
        if device == "cuda" {
            cmd.env("CUDA_VISIBLE_DEVICES", rank.to_string());
        }
        children.push(cmd.spawn().context("starting a ferl rank")?);
    }
    for (rank, mut child) in children.into_iter().enumerate() {
        let status = child.wait()?;
        if !status.success() {
            bail!("ferl rank {rank} of {world} failed ({status})");
        }
    }
    (0..world)
        .map(|r| SideRecord::read(&out.join(format!("rank_{r}.json"))))
        .collect()
}

/// Runs the PyTorch FSDP2 peer with `world` ranks inside a private network namespace and reads their records.
fn run_pytorch(dir: &Path, world: usize, threads: usize) -> Result<Vec<SideRecord>> {
    let out = dir.join(format!("pytorch_w{world}"));
    std::fs::create_dir_all(&out)?;
    let py = python();
    let result = Command::new("unshare")
        .args([
            "-n",
            "bash",
            "-c",
            r#"ip link set lo up && exec "$@""#,
            "bash",
        ])
        .arg(&py)
        .arg(py_script("fsdp2_reference.py"))
        .args(["--world", &world.to_string()])
        .arg("--model")
        .arg(dir.join("model"))
        .arg("--data")
        .arg(dir.join("data.json"))
        .arg("--settings")
        .arg(dir.join("settings.json"))
        .arg("--out-dir")
        .arg(&out)
        .args(["--threads", &threads.to_string()])
        .env("OMP_NUM_THREADS", threads.to_string())
        .output()
        .context("starting the PyTorch FSDP2 peer under `unshare -n`")?;
    if !result.status.success() {
        bail!(
            "PyTorch FSDP2 peer ({}) failed ({}); is torch installed in that venv (scripts/setup.sh)?\n{}",
            py.display(),
            result.status,
            String::from_utf8_lossy(&result.stderr)
        );
    }
    (0..world)
        .map(|r| SideRecord::read(&out.join(format!("rank_{r}.json"))))
        .collect()
}

/// The config a ferl rank trains with: the same loop as the PyTorch peer (see `common::settings`); fp32 on the CPU,
/// `--dtype` compute (fp32 masters) on CUDA.
fn rank_config(a: &TrainArgs, dir: &Path, device: Device) -> Result<SftConfig> {
    let mut keys = vec![
        format!(
            "trainer.device={}",
            if device.is_cuda() { "cuda" } else { "cpu" }
        ),
        "model.fsdp_config.model_dtype=fp32".into(),
    ];
    if device.is_cuda() {
        keys.push(format!(
            "model.fsdp_config.mixed_precision.param_dtype={}",
            a.dtype
        ));
    }
    keys.extend([
        format!("model.partial_pretrain={}", dir.join("model").display()),
        format!(
            "model.enable_gradient_checkpointing={}",
            a.gradient_checkpointing
        ),
        "optim.lr=1e-4".into(),
        "optim.lr_scheduler=constant".into(),
        "optim.lr_warmup_steps_ratio=0.0".into(),
        "optim.weight_decay=0.01".into(),
        "optim.betas=[0.9,0.95]".into(),
        "optim.clip_grad=1.0".into(),
        format!("data.train_batch_size={}", a.batch),
        format!("data.micro_batch_size_per_gpu={}", a.micro_batch),
        format!("use_remove_padding={}", a.rank_sp.is_some()),
        format!("ulysses_sequence_parallel_size={}", a.rank_sp.unwrap_or(1)),
    ]);
    SftConfig::load(None, &keys)
}

/// One ferl rank (`--rank-child DIR`): joins the group from the environment and trains its share of each global
/// batch of `DIR/data.json`, writing `DIR/ferl_wW/rank_R.json`.
pub(super) fn rank_child(a: &TrainArgs, dir: &Path) -> Result<()> {
    tch::set_num_threads(a.threads.unwrap_or(1) as i32);
    let device = super::shape::resolve_device(a.device.as_deref().unwrap_or("cpu"))?;
    let samples = read_samples(dir)?;
    let cfg = rank_config(a, dir, device)?;
    let (comm, subgroups) = init_groups_from_env(device).context("joining the ferl group")?;
    let (rank, world) = (comm.rank(), comm.world_size());
    let mut state = RankState::build(cfg, comm, device, a.steps as u64)?;
    state.join_sequence_parallel(|name, r, size| subgroups.connect(name, r, size))?;
    let (dp_rank, dp_world) = state.data_rank_and_world();
    state.sum_over_ranks(&[0.0]).context("barrier")?;
    let gemm_flops_per_s = (device == Device::Cpu).then(super::mfu::gemm_peak_flops);
    let (mut tokens, mut secs, mut losses, mut peak) = (Vec::new(), Vec::new(), Vec::new(), 0u64);
    for step in 0..a.steps {
        let indices: Vec<usize> = (step * a.batch..(step + 1) * a.batch).collect();
        if indices.last().is_some_and(|&i| i >= samples.len()) {
            bail!(
                "step {step}: {} samples prepared, fewer than {} steps of {}",
                samples.len(),
                a.steps,
                a.batch
            );
        }
        let global_targets: i64 = indices.iter().map(|&i| samples[i].num_targets()).sum();
        let global_tokens: usize = indices.iter().map(|&i| samples[i].input_ids.len()).sum();
        let mine: Vec<_> = rank_shard(&indices, dp_rank, dp_world)
            .iter()
            .map(|&i| samples[i].clone())
            .collect();
        state.sum_over_ranks(&[0.0]).context("barrier")?;
        let started = Instant::now();
        let reply = state
            .train_step(&mine, global_targets)
            .with_context(|| format!("rank {rank}: step {step}"))?;
        let loss = state.sum_over_ranks(&[reply.loss_share])?[0];
        secs.push(started.elapsed().as_secs_f64());
        tokens.push(global_tokens as f64);
        losses.push(loss);
        peak = peak.max(reply.peak_memory_bytes);
    }
    let comm = state.stepper.engine.store().comm_stats();
    eprintln!(
        "ferl rank {rank}/{world}: {:.2} s timed, {} all-gathers ({} prefetched), {} reductions, {:.2} s waiting for gathers",
        secs[1..].iter().sum::<f64>(),
        comm.all_gathers,
        comm.prefetch_hits,
        comm.reductions,
        comm.gather_wait.as_secs_f64()
    );
    let record = serde_json::json!({
        "tokens": tokens, "step_s": secs, "loss": losses, "peak_rss_kib": peak as f64 / 1024.0,
        "gemm_flops_per_s": gemm_flops_per_s,
    });
    let file = dir
        .join(format!("ferl_w{world}"))
        .join(format!("rank_{rank}.json"));
    std::fs::write(&file, record.to_string())
        .with_context(|| format!("writing {}", file.display()))?;
    Ok(())
}
