//! `ferl-bench collectives`: the CPU backend's collectives (2 processes on one host, fp32) beside torch.distributed's
//! gloo backend measured the same way (same sizes, iteration counts and formula; gloo runs in `unshare -n`). The ferl
//! side runs twice: with its default transport between ranks on one host (shared memory; rows without a prefix) and
//! forced onto loopback TCP as ranks on different hosts would talk (rows prefixed `tcp_`).
//!
//! Bandwidth is nccl-tests' *bus bandwidth*: `size / time × 2(n−1)/n` for all-reduce and `size / time × (n−1)/n` for
//! all-gather and reduce-scatter, where `size` is the full buffer (the all-reduce tensor, the all-gather output, the
//! reduce-scatter input) and n = 2 ranks. Rows: `<op>_<size>_GBps`, `<op>_1KiB_us` (latency), the same with `tcp_` and
//! `gloo_` prefixes, and `<row>_vs_gloo` ratios (bandwidth: ferl / gloo, higher is better; latency: ferl / gloo, lower
//! is better).
//! Each side runs `--repeat` times, alternating, and each row keeps its best figure, so load from other processes on a
//! shared machine penalises neither side more than the other.

use crate::report::Report;
use anyhow::{bail, Context, Result};
use clap::Args;
use ferl_collective::{
    Communicator, GroupOptions, LaunchEnv, ReduceOp, TcpCommunicator, TcpStoreServer, Transport,
};
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Instant;
use tch::{Device, Kind, Tensor};

const WORLD: usize = 2;
const GLOO_SCRIPT: &str = include_str!("collectives/gloo_bench.py");
/// Tells a worker which transport its pair must have negotiated (`shm` or `tcp`), so no row measures the wrong one.
const TRANSPORT_VAR: &str = "FERL_BENCH_TRANSPORT";

/// Options of the collectives suite.
#[derive(Args, Debug)]
pub(crate) struct CollectivesArgs {
    /// Buffer sizes (KiB/MiB suffixes).
    #[arg(long, value_delimiter = ',', default_value = "1KiB,1MiB,16MiB,128MiB")]
    sizes: Vec<String>,
    /// Skip the gloo comparison.
    #[arg(long)]
    no_gloo: bool,
    /// Transports of the ferl side: `shm` (the default between ranks on one host) and/or `tcp` (rows `tcp_*`).
    #[arg(long, value_delimiter = ',', default_value = "shm,tcp")]
    transports: Vec<String>,
    /// Measurements per side, alternating ferl and gloo; each row keeps the best (the machine may be shared).
    #[arg(long, default_value_t = 3)]
    repeat: usize,
    /// Internal: run as one rank of the ferl side (environment from the parent).
    #[arg(long, hide = true)]
    worker: bool,
}

fn parse_size(label: &str) -> Result<usize> {
    let (num, unit) = label.split_at(
        label
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(label.len()),
    );
    let n: usize = num
        .parse()
        .with_context(|| format!("size {label:?}: expected e.g. 16MiB"))?;
    Ok(n * match unit {
        "" | "B" => 1,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        other => bail!("size {label:?}: unknown unit {other:?}"),
    })
}

/// Iterations per measurement: about 256 MiB moved, between 5 and 2000 (the gloo script uses the same rule).
fn iterations(bytes: usize) -> usize {
    ((256usize << 20) / bytes).clamp(5, 2000)
}

/// Runs the suite and prints its rows.
pub(crate) fn run(args: CollectivesArgs, out: &mut Report) -> Result<()> {
    let sizes: Vec<(String, usize)> = args
        .sizes
        .iter()
        .map(|s| parse_size(s).map(|b| (s.clone(), b)))
        .collect::<Result<_>>()?;
    if args.worker {
        return worker(&sizes);
    }
    for t in &args.transports {
        if t != "shm" && t != "tcp" {
            bail!("--transports: unknown transport {t:?} (expected shm, tcp)");
        }
    }
    let (mut ferl, mut gloo) = (Vec::new(), Vec::new());
    for _ in 0..args.repeat.max(1) {
        for transport in &args.transports {
            let prefix = if transport == "tcp" { "tcp_" } else { "" };
            let rows = run_ferl(&args.sizes, transport)?
                .into_iter()
                .map(|(name, value, unit)| (format!("{prefix}{name}"), value, unit))
                .collect();
            keep_best(&mut ferl, rows);
        }
        if !args.no_gloo {
            keep_best(&mut gloo, run_gloo(&sizes)?);
        }
    }
    // Each figure with its TCP twin, the gloo figure and the ratios.
    let mut bases: Vec<&str> = Vec::new();
    for (name, _, _) in &ferl {
        let base = name.strip_prefix("tcp_").unwrap_or(name);
        if !bases.contains(&base) {
            bases.push(base);
        }
    }
    for base in bases {
        let tcp = format!("tcp_{base}");
        let mine: Vec<&Row> = ferl
            .iter()
            .filter(|(n, _, _)| n == base || *n == tcp)
            .collect();
        for (name, value, unit) in &mine {
            out.row(name, *value, unit);
        }
        if let Some((_, g, unit)) = gloo.iter().find(|(n, _, _)| n == base) {
            out.row(&format!("gloo_{base}"), *g, unit);
            for (name, value, _) in &mine {
                out.row(&format!("{name}_vs_gloo"), value / g, "x");
            }
        }
    }
    Ok(())
}

type Row = (String, f64, String);

/// Merges `new` into `best`, keeping per row the highest bandwidth or the lowest latency.
fn keep_best(best: &mut Vec<Row>, new: Vec<Row>) {
    for (name, value, unit) in new {
        match best.iter_mut().find(|(n, _, _)| *n == name) {
            Some(row) if unit == "us" => row.1 = row.1.min(value),
            Some(row) => row.1 = row.1.max(value),
            None => best.push((name, value, unit)),
        }
    }
}

fn parse_rows(stdout: impl std::io::Read) -> Vec<Row> {
    BufReader::new(stdout)
        .lines()
        .map_while(Result::ok)
        .filter_map(|line| {
            let mut it = line.strip_prefix("ROW ")?.split_whitespace();
            let name = it.next()?.to_string();
            let value = it.next()?.parse().ok()?;
            Some((name, value, it.next()?.to_string()))
        })
        .collect()
}

fn run_ferl(sizes: &[String], transport: &str) -> Result<Vec<Row>> {
    let secret = ferl_collective::JobSecret::generate()?;
    let store = TcpStoreServer::bind("127.0.0.1:0", secret.clone())?;
    let exe = std::env::current_exe()?;
    let mut children = Vec::new();
    for rank in 0..WORLD {
        let child = Command::new(&exe)
            .args(["collectives", "--worker", "--sizes", &sizes.join(",")])
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", WORLD.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env(ferl_collective::JOB_SECRET_ENV, secret.to_hex())
            .env("MASTER_PORT", store.local_addr().port().to_string())
            .env("FERL_STORE_HOSTED", "1")
            .env(TRANSPORT_VAR, transport)
            .env(
                "FERL_COLLECTIVE_SHM",
                if transport == "tcp" { "0" } else { "1" },
            )
            .stdout(if rank == 0 {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .spawn()
            .context("starting a collectives worker")?;
        children.push(child);
    }
    let rows = parse_rows(children[0].stdout.take().context("worker stdout")?);
    for (rank, mut child) in children.into_iter().enumerate() {
        if !child.wait()?.success() {
            bail!("collectives worker rank {rank} failed");
        }
    }
    Ok(rows)
}

fn run_gloo(sizes: &[(String, usize)]) -> Result<Vec<Row>> {
    let venv = std::env::var("FERL_VENV").unwrap_or_else(|_| {
        format!(
            "{}/.cache/ferl/venv",
            std::env::var("HOME").unwrap_or_default()
        )
    });
    let script = std::env::temp_dir().join(format!("ferl-bench-gloo-{}.py", std::process::id()));
    std::fs::write(&script, GLOO_SCRIPT)?;
    let mut cmd = Command::new("unshare");
    cmd.args([
        "-n",
        "bash",
        "-c",
        r#"ip link set lo up && exec "$@""#,
        "bash",
        &format!("{venv}/bin/python"),
    ])
    .arg(&script)
    .args(
        sizes
            .iter()
            .map(|(label, bytes)| format!("{label}={bytes}")),
    )
    .stdout(Stdio::piped());
    let mut child = cmd
        .spawn()
        .context("starting the gloo peer under `unshare -n`")?;
    let rows = parse_rows(child.stdout.take().context("gloo stdout")?);
    let status = child.wait()?;
    let _ = std::fs::remove_file(&script);
    if !status.success() {
        bail!("the gloo peer failed ({status}); is torch installed in {venv}?");
    }
    Ok(rows)
}

/// Joins the group of the launcher environment (as `init_from_env` does) and checks the transport to the peer.
fn join() -> Result<TcpCommunicator> {
    let launch = LaunchEnv::from_env()?;
    let mut options = GroupOptions::default();
    let store = launch.rendezvous(true, &options)?;
    options.bind_ip = Some(store.local_ip());
    let comm = TcpCommunicator::connect(launch.rank, launch.world_size, Arc::new(store), &options)?;
    let expected = match std::env::var(TRANSPORT_VAR).as_deref() {
        Ok("tcp") => Transport::Tcp,
        _ => Transport::SharedMemory,
    };
    let peer = (comm.rank() + 1) % comm.world_size();
    let got = comm.transport(peer);
    if got != Some(expected) {
        bail!(
            "rank {}: expected {expected:?} to rank {peer}, got {got:?}",
            comm.rank()
        );
    }
    Ok(comm)
}

/// One rank of the ferl side; rank 0 prints `ROW` lines.
fn worker(sizes: &[(String, usize)]) -> Result<()> {
    let comm = join()?;
    let w = comm.world_size();
    for (label, bytes) in sizes {
        let n = (bytes / 4) as i64;
        let mut t = Tensor::ones([n], (Kind::Float, Device::Cpu));
        let part = Tensor::ones([n / w as i64], (Kind::Float, Device::Cpu));
        let mut full = Tensor::empty([n], (Kind::Float, Device::Cpu));
        let mut shard = Tensor::empty([n / w as i64], (Kind::Float, Device::Cpu));
        let ar = timed(&comm, *bytes, || comm.all_reduce(&mut t, ReduceOp::Sum))?;
        let ag = timed(&comm, *bytes, || comm.all_gather(&mut full, &part))?;
        let rs = timed(&comm, *bytes, || {
            comm.reduce_scatter(&mut shard, &t, ReduceOp::Sum)
        })?;
        if comm.rank() == 0 {
            let ring = (w - 1) as f64 / w as f64;
            for (op, seconds, factor) in [
                ("all_reduce", ar, 2.0 * ring),
                ("all_gather", ag, ring),
                ("reduce_scatter", rs, ring),
            ] {
                println!(
                    "ROW {op}_{label}_GBps {} GB/s",
                    *bytes as f64 / seconds * factor / 1e9
                );
                if *bytes <= 64 << 10 {
                    println!("ROW {op}_{label}_us {} us", seconds * 1e6);
                }
            }
        }
    }
    comm.barrier()
}

/// Seconds per call of `op`, after a warm-up and a barrier.
fn timed(comm: &dyn Communicator, bytes: usize, mut op: impl FnMut() -> Result<()>) -> Result<f64> {
    for _ in 0..if bytes <= 64 << 10 { 20 } else { 2 } {
        op()?;
    }
    comm.barrier()?;
    let iters = iterations(bytes);
    let start = Instant::now();
    for _ in 0..iters {
        op()?;
    }
    Ok(start.elapsed().as_secs_f64() / iters as f64)
}
