//! The head's view of the cluster as JSON, for `ferl status` and [`crate::Cluster::status`].

use crate::control::supervision::Life;
use crate::protocol::Resources;

use super::Head;

/// Key prefix of the KV entries `ferl status` lists as jobs: each value is a JSON object a driver keeps current
/// (e.g. a training run's world size, state and restarts).
pub const JOBS_PREFIX: &str = "jobs/";

impl Head {
    /// The cluster's state as `ferl status --json` prints it: `nodes` (resources total and used, log folder),
    /// `actors`, `groups` (with lost bundles and owning driver), `jobs` (the JSON values drivers keep under
    /// [`JOBS_PREFIX`]), the `drivers` that joined and still beat, the `submitted_jobs` the head runs (`ferl job`),
    /// and the number of KV keys.
    pub(super) fn status_json(&self) -> serde_json::Value {
        let st = self.lock();
        let used = |n: &str| -> Resources {
            let Some(cap) = st.placement.node(n) else {
                return Resources::new();
            };
            cap.total
                .iter()
                .map(|(k, v)| (k.clone(), v - cap.free.get(k).copied().unwrap_or(0.0)))
                .collect()
        };
        let nodes: Vec<serde_json::Value> = st
            .nodes
            .iter()
            .map(|(name, n)| {
                let actors: Vec<u64> = st.actors.iter().filter(|(_, a)| &a.node == name && a.sup.life == Life::Alive).map(|(i, _)| *i).collect();
                serde_json::json!({
                    "name": name, "address": n.addr.to_string(), "ip": n.ip, "alive": n.alive,
                    "resources_total": n.resources, "resources_used": used(name), "log_dir": n.log_dir, "actors": actors,
                })
            })
            .collect();
        let actors: Vec<serde_json::Value> = st
            .actors
            .iter()
            .map(|(id, a)| {
                let state = match &a.sup.life {
                    Life::Starting => "starting".to_string(),
                    Life::Alive => "alive".into(),
                    Life::Restarting(n) => format!("restarting (attempt {n})"),
                    Life::Dead(r) => format!("dead: {r}"),
                };
                serde_json::json!({"id": id, "type": a.spec.type_name, "name": a.spec.name, "node": a.node, "address": a.addr, "state": state})
            })
            .collect();
        let groups: Vec<serde_json::Value> = st
            .groups
            .iter()
            .map(|(id, g)| {
                let bundles: Vec<_> = g.slots.iter().enumerate().map(|(b, s)| serde_json::json!({"node": s.node, "resources": s.resources, "gpus": s.gpus, "lost": g.lost.get(&b)})).collect();
                serde_json::json!({"id": id, "strategy": format!("{:?}", g.strategy), "bundles": bundles, "actors": g.actors, "driver": g.owner})
            })
            .collect();
        let jobs: Vec<serde_json::Value> = st
            .kv
            .iter()
            .filter(|(k, _)| k.starts_with(JOBS_PREFIX))
            .filter_map(|(_, v)| serde_json::from_slice(v).ok())
            .collect();
        let drivers: Vec<serde_json::Value> = st
            .drivers
            .entries()
            .iter()
            .map(|(id, d)| serde_json::json!({"id": id, "pid": d.pid, "host": d.host, "command": d.command}))
            .collect();
        serde_json::json!({"head": self.0.process.addr.to_string(), "nodes": nodes, "actors": actors, "groups": groups, "jobs": jobs, "drivers": drivers, "submitted_jobs": self.0.jobs.json(), "kv_keys": st.kv.len()})
    }
}
