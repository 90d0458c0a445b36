//! `ferl-sft-driver [--nproc-per-node N [--nnodes M --address HOST:PORT] | --one-process] --summary FILE key=value...`: runs SFT through
//! [`ferl_actors::sft::run`] (actors on an embedded cluster with `--nproc-per-node`, world 1 in this process with
//! `--one-process`, else one rank of an external launch read from the environment) and writes the run summary as
//! JSON to FILE.

use anyhow::{bail, Context, Result};

fn main() -> Result<()> {
    ferl_actors::ensure_linked();
    ferl::enter_worker_mode_if_spawned();
    ferl::init_tracing();
    let mut args = std::env::args().skip(1);
    let (mut nproc, mut one, mut summary, mut overrides) = (0usize, false, None, Vec::new());
    let (mut address, mut nnodes) = (None, 1usize);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--nproc-per-node" => {
                nproc = args
                    .next()
                    .context("--nproc-per-node needs a number")?
                    .parse()?
            }
            "--one-process" => one = true,
            "--address" => address = Some(args.next().context("--address needs HOST:PORT")?),
            "--nnodes" => nnodes = args.next().context("--nnodes needs a number")?.parse()?,
            "--summary" => summary = Some(args.next().context("--summary needs a path")?),
            s if s.starts_with("--") => bail!("unknown flag {s}"),
            _ => overrides.push(a),
        }
    }
    let cfg = ferl_config::SftConfig::load(None, &overrides)?;
    let launch = match (nproc, one) {
        (0, true) => ferl_actors::sft::Launch::OneProcess,
        (0, false) => ferl_actors::sft::Launch::Launcher,
        (n, _) => ferl_actors::sft::Launch::Cluster {
            nproc_per_node: n,
            nnodes,
            address,
        },
    };
    let result = ferl_actors::sft::run(cfg, &launch)?;
    if let Some(path) = summary {
        std::fs::write(&path, serde_json::to_vec_pretty(&result)?)
            .with_context(|| format!("writing {path}"))?;
    }
    Ok(())
}
