//! `ferl-runtime-testbed`: the worker binary of the runtime's multi-process tests, and a way to run a standalone
//! head or node agent from them (`head`, `node` subcommands print `ADDRESS <addr>` / `TOKEN <token>` then block).

use std::time::Duration;

use anyhow::{bail, Context, Result};

fn flag(args: &[String], name: &str) -> Option<String> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

fn node_options(args: &[String]) -> Result<ferl_runtime::NodeOptions> {
    let mut opts = ferl_runtime::NodeOptions::new();
    if let Some(c) = flag(args, "--num-cpus") {
        opts = opts.num_cpus(c.parse().context("--num-cpus")?);
    }
    opts = opts.num_gpus(
        flag(args, "--num-gpus")
            .map(|g| g.parse())
            .transpose()
            .context("--num-gpus")?
            .unwrap_or(0),
    );
    if let Some(r) = flag(args, "--resources") {
        opts = opts.resources(ferl_runtime::parse_resources(&[r])?);
    }
    if let Some(ms) = flag(args, "--heartbeat-ms") {
        opts = opts.heartbeat_bound(Duration::from_millis(ms.parse().context("--heartbeat-ms")?));
    }
    Ok(opts)
}

// `#[tokio::main]` on purpose: worker mode must work when `main` already runs inside a tokio runtime.
#[tokio::main]
async fn main() -> Result<()> {
    ferl_runtime::enter_worker_mode_if_spawned();
    let filter =
        tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into());
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
    let args: Vec<String> = std::env::args().collect();
    {
        match args.get(1).map(String::as_str) {
            Some("head") => {
                let opts = ferl_runtime::HeadOptions::new().node(node_options(&args)?);
                let head = ferl_runtime::start_head(opts).await?;
                println!("ADDRESS {}", head.cluster.head_address()?);
                println!("TOKEN {}", head.token);
                std::future::pending::<()>().await;
                Ok(())
            }
            Some("node") => {
                let address = flag(&args, "--address").context("node needs --address")?;
                let node = ferl_runtime::start_node(
                    &address,
                    flag(&args, "--token"),
                    node_options(&args)?,
                    None,
                )
                .await?;
                println!("NODE {}", node.name);
                Ok(node.wait().await?)
            }
            other => bail!("usage: ferl-runtime-testbed head|node [...] (got {other:?})"),
        }
    }
}
