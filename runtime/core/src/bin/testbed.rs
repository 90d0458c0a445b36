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
            Some("driver") => fate_driver(&args).await,
            other => bail!("usage: ferl-runtime-testbed head|node|driver [...] (got {other:?})"),
        }
    }
}

/// `driver --address A --token T`: joins as a driver, spawns the named counters `fate/owned` and (detached)
/// `fate/kept` and reserves a one-CPU group, prints `READY`, then blocks until killed (guarantee 17's test).
async fn fate_driver(args: &[String]) -> Result<()> {
    use ferl_runtime::testbed::Counter;
    use ferl_runtime::{bundle, SpawnOptions, Strategy};
    let address = flag(args, "--address").context("driver needs --address")?;
    let cluster = ferl_runtime::connect(&address, flag(args, "--token")).await?;
    cluster
        .spawn::<Counter>(1, SpawnOptions::new().name("fate", "owned"))
        .await?;
    cluster
        .spawn::<Counter>(2, SpawnOptions::new().name("fate", "kept").detached())
        .await?;
    cluster
        .create_group(
            vec![bundle(&[("CPU", 1.0)])],
            Strategy::Pack,
            Duration::from_secs(10),
        )
        .await?;
    println!(
        "READY {}",
        cluster.driver_id().context("a registered driver")?
    );
    std::future::pending::<()>().await;
    Ok(())
}
