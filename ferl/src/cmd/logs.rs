//! `ferl logs`: a node's log files, read through its node agent from any machine holding the token, like `ray logs`:
//! `--node NAME` lists them, `--node NAME FILE` prints one, `--actor ID` prints the log of the worker that hosts an
//! actor.

use anyhow::{bail, Context, Result};
use clap::Args;
use ferl_runtime::Cluster;

use super::job::{print_log, HeadArgs};

/// Arguments of `ferl logs`.
#[derive(Args, Debug)]
pub(crate) struct LogsArgs {
    #[command(flatten)]
    head: HeadArgs,
    /// Print the log of the worker hosting this actor (its id, as `ferl status` shows it).
    #[arg(long, conflicts_with_all = ["node", "file"], required_unless_present = "node")]
    actor: Option<u64>,
    /// List the log files of this node (as `ferl status` names it), or print FILE of them.
    #[arg(long)]
    node: Option<String>,
    /// A file of the node's logs, as listed.
    #[arg(requires = "node")]
    file: Option<String>,
    /// Keep printing as the log grows (a worker's log: until its process exits).
    #[arg(long, short)]
    follow: bool,
}

/// `ferl logs`.
pub(crate) fn run(args: LogsArgs) -> Result<()> {
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(async {
        let cluster = args.head.connect().await?;
        let done = logs(&cluster, &args).await;
        cluster.shutdown().await;
        done
    })
}

async fn logs(cluster: &Cluster, args: &LogsArgs) -> Result<()> {
    let (node, file) = match (&args.actor, &args.node, &args.file) {
        (Some(id), ..) => actor_log(cluster, *id).await?,
        (None, Some(node), Some(file)) => (node.clone(), file.clone()),
        (None, Some(node), None) => {
            for (name, size) in cluster.node_log_files(node).await? {
                println!("{size:>12} {name}");
            }
            return Ok(());
        }
        (None, None, _) => bail!("`ferl logs` needs --actor ID or --node NAME"),
    };
    let (node, file) = (node.as_str(), file.as_str());
    print_log(args.follow, async |offset| {
        Ok(cluster.read_node_log(node, file, offset).await?)
    })
    .await
}

/// The node and log file of the worker hosting actor `id`.
async fn actor_log(cluster: &Cluster, id: u64) -> Result<(String, String)> {
    let status = cluster.status().await?;
    let actor = status["actors"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|a| a["id"].as_u64() == Some(id))
        .with_context(|| format!("no actor {id} in the cluster"))?;
    let node = actor["node"]
        .as_str()
        .filter(|n| !n.is_empty())
        .with_context(|| format!("actor {id} was never placed on a node"))?;
    let prefix = format!("worker-{id}-");
    let files = cluster.node_log_files(node).await?;
    let Some((file, _)) = files.iter().find(|(f, _)| f.starts_with(&prefix)) else {
        bail!("actor {id} has no log on {node} (no `{prefix}*` there)");
    };
    Ok((node.to_string(), file.clone()))
}
