//! Reading a node's logs from any machine holding the token (`ferl logs --node NAME`, `ferl logs --actor ID`): its
//! node agent serves the files of its logs folder over the control plane.

use std::net::SocketAddr;

use super::Cluster;
use crate::actor::process::NODE_ACTOR;
use crate::protocol::{ListLogs, LogChunk, ReadLog};
use crate::transport::error::{Error, Result};

impl Cluster {
    /// The control address of the node named `name`, from the head's status.
    async fn node_address(&self, name: &str) -> Result<SocketAddr> {
        let status = self.status().await?;
        let nodes = status["nodes"].as_array().cloned().unwrap_or_default();
        let Some(node) = nodes.iter().find(|n| n["name"] == name) else {
            let names: Vec<&str> = nodes.iter().filter_map(|n| n["name"].as_str()).collect();
            return Err(Error::Cluster(format!(
                "no node named `{name}` in the cluster (nodes: {})",
                names.join(", ")
            )));
        };
        let address = node["address"].as_str().unwrap_or_default();
        address
            .parse()
            .map_err(|_| Error::Cluster(format!("node `{name}` has a bad address `{address}`")))
    }

    /// The files of node `node`'s logs folder (worker logs `worker-ID-TYPE.log`; on the head's node also the jobs'
    /// `job-N.log`), by name, with their sizes in bytes.
    pub async fn node_log_files(&self, node: &str) -> Result<Vec<(String, u64)>> {
        let addr = self.node_address(node).await?;
        self.process.call_at(addr, NODE_ACTOR, &ListLogs).await
    }

    /// A piece of file `file` of node `node`'s logs folder from byte `offset` (at most 1 MiB; `finished` once a
    /// worker log's process has exited and nothing is left).
    pub async fn read_node_log(&self, node: &str, file: &str, offset: u64) -> Result<LogChunk> {
        let addr = self.node_address(node).await?;
        let m = ReadLog {
            file: file.into(),
            offset,
        };
        self.process.call_at(addr, NODE_ACTOR, &m).await
    }
}
