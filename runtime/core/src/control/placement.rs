//! Placement of resource-group bundles and single actors onto nodes. Pure state, no I/O: the head feeds it node
//! joins/losses and asks it to reserve or release; tests drive it directly.
//!
//! Invariants (guarantee 4 in `runtime/README.md`): a group is reserved all-or-nothing; a group that could never fit
//! the cluster's total resources is `Infeasible` with a message naming what is missing; one that fits the totals but
//! not what is free now is `Busy` (the head waits and retries up to the caller's timeout); releasing returns exactly
//! what was reserved, GPU indices included.

use std::collections::BTreeMap;

use crate::protocol::{Resources, Strategy};

const EPS: f64 = 1e-9;

/// A node's capacity as placement sees it.
#[derive(Debug, Clone)]
pub(crate) struct NodeCapacity {
    /// Declared resources.
    pub total: Resources,
    /// Resources not reserved.
    pub free: Resources,
    /// GPU indices not reserved.
    pub free_gpus: Vec<u32>,
}

/// One reserved bundle: where it is and what it holds.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct BundleSlot {
    /// Node name.
    pub node: String,
    /// Reserved resources.
    pub resources: Resources,
    /// Reserved GPU indices on that node.
    pub gpus: Vec<u32>,
}

/// Why a reservation failed.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum PlaceError {
    /// It can never fit this cluster; the message names what is missing.
    Infeasible(String),
    /// It fits the cluster's totals but not what is free now.
    Busy(String),
}

impl std::fmt::Display for PlaceError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PlaceError::Infeasible(m) => write!(f, "infeasible: {m}"),
            PlaceError::Busy(m) => write!(f, "resources busy: {m}"),
        }
    }
}

/// The resources of every live node.
#[derive(Debug, Default, Clone)]
pub(crate) struct Placement {
    nodes: BTreeMap<String, NodeCapacity>,
}

fn fits(avail: &Resources, need: &Resources) -> bool {
    need.iter()
        .all(|(k, v)| *v <= EPS || avail.get(k).copied().unwrap_or(0.0) + EPS >= *v)
}

fn sub(avail: &mut Resources, need: &Resources) {
    for (k, v) in need {
        *avail.entry(k.clone()).or_insert(0.0) -= v;
    }
}

fn add(avail: &mut Resources, need: &Resources) {
    for (k, v) in need {
        *avail.entry(k.clone()).or_insert(0.0) += v;
    }
}

fn sum(bundles: &[Resources]) -> Resources {
    let mut total = Resources::new();
    for b in bundles {
        add(&mut total, b);
    }
    total
}

/// Formats resources as `{CPU: 2, GPU: 1}`.
pub(crate) fn show(r: &Resources) -> String {
    let inner: Vec<String> = r
        .iter()
        .filter(|(_, v)| v.abs() > EPS)
        .map(|(k, v)| format!("{k}: {v}"))
        .collect();
    format!("{{{}}}", inner.join(", "))
}

/// Assigns bundles to nodes given what each node has; `None` when the strategy cannot be satisfied.
fn assign(
    avail: &BTreeMap<String, Resources>,
    bundles: &[Resources],
    strategy: Strategy,
) -> Option<Vec<String>> {
    let mut avail = avail.clone();
    let mut out = vec![String::new(); bundles.len()];
    // Largest bundles first so greedy choices leave room for small ones.
    let mut order: Vec<usize> = (0..bundles.len()).collect();
    let weight = |i: usize| bundles[i].values().sum::<f64>();
    order.sort_by(|a, b| weight(*b).total_cmp(&weight(*a)));
    match strategy {
        Strategy::NodeBlocks(per_node) => {
            let per_node = (per_node as usize).max(1);
            let blocks: Vec<Resources> = bundles.chunks(per_node).map(sum).collect();
            let nodes = assign(&avail, &blocks, Strategy::StrictSpread)?;
            for (i, o) in out.iter_mut().enumerate() {
                *o = nodes[i / per_node].clone();
            }
        }
        Strategy::StrictPack => {
            let total = sum(bundles);
            let node = avail.iter().find(|(_, a)| fits(a, &total))?.0.clone();
            out.iter_mut().for_each(|o| *o = node.clone());
        }
        Strategy::Pack => {
            let total = sum(bundles);
            if let Some((node, _)) = avail.iter().find(|(_, a)| fits(a, &total)) {
                let node = node.clone();
                out.iter_mut().for_each(|o| *o = node.clone());
            } else {
                for &i in &order {
                    // Prefer nodes already used, then the fullest free node.
                    let used: Vec<String> = out.iter().filter(|n| !n.is_empty()).cloned().collect();
                    let node = used
                        .iter()
                        .find(|n| fits(&avail[*n], &bundles[i]))
                        .cloned()
                        .or_else(|| {
                            avail
                                .iter()
                                .find(|(_, a)| fits(a, &bundles[i]))
                                .map(|(n, _)| n.clone())
                        })?;
                    sub(avail.get_mut(&node)?, &bundles[i]);
                    out[i] = node;
                }
            }
        }
        Strategy::Spread | Strategy::StrictSpread => {
            let mut uses: BTreeMap<String, usize> = avail.keys().map(|k| (k.clone(), 0)).collect();
            for &i in &order {
                let mut candidates: Vec<&String> = avail
                    .iter()
                    .filter(|(_, a)| fits(a, &bundles[i]))
                    .map(|(n, _)| n)
                    .collect();
                if strategy == Strategy::StrictSpread {
                    candidates.retain(|n| uses[*n] == 0);
                }
                let node = (*candidates.iter().min_by_key(|n| uses[**n])?).clone();
                sub(avail.get_mut(&node)?, &bundles[i]);
                *uses.get_mut(&node)? += 1;
                out[i] = node;
            }
        }
    }
    Some(out)
}

impl Placement {
    /// Adds a node with its declared resources (GPU indices `0..GPU`).
    pub(crate) fn add_node(&mut self, name: &str, total: Resources) {
        let gpus = total.get("GPU").copied().unwrap_or(0.0).floor() as u32;
        self.nodes.insert(
            name.to_string(),
            NodeCapacity {
                free: total.clone(),
                total,
                free_gpus: (0..gpus).collect(),
            },
        );
    }

    /// Forgets a node (it died); its reservations vanish with it.
    pub(crate) fn remove_node(&mut self, name: &str) {
        self.nodes.remove(name);
    }

    /// A node's capacity.
    pub(crate) fn node(&self, name: &str) -> Option<&NodeCapacity> {
        self.nodes.get(name)
    }

    /// Reserves every bundle or none.
    pub(crate) fn reserve(
        &mut self,
        bundles: &[Resources],
        strategy: Strategy,
    ) -> Result<Vec<BundleSlot>, PlaceError> {
        let totals: BTreeMap<String, Resources> = self
            .nodes
            .iter()
            .map(|(n, c)| (n.clone(), c.total.clone()))
            .collect();
        if assign(&totals, bundles, strategy).is_none() {
            return Err(PlaceError::Infeasible(self.explain(bundles, strategy)));
        }
        let free: BTreeMap<String, Resources> = self
            .nodes
            .iter()
            .map(|(n, c)| (n.clone(), c.free.clone()))
            .collect();
        let Some(nodes) = assign(&free, bundles, strategy) else {
            return Err(PlaceError::Busy(format!(
                "{} bundles {} with {strategy:?} fit the cluster but not its free resources now",
                bundles.len(),
                bundles.iter().map(show).collect::<Vec<_>>().join(" ")
            )));
        };
        let mut slots = Vec::with_capacity(bundles.len());
        for (bundle, node) in bundles.iter().zip(nodes) {
            let cap = self.nodes.get_mut(&node).expect("assigned node exists");
            sub(&mut cap.free, bundle);
            let want = bundle.get("GPU").copied().unwrap_or(0.0).ceil() as usize;
            let gpus: Vec<u32> = cap
                .free_gpus
                .drain(..want.min(cap.free_gpus.len()))
                .collect();
            slots.push(BundleSlot {
                node,
                resources: bundle.clone(),
                gpus,
            });
        }
        Ok(slots)
    }

    /// Returns reserved bundles to their nodes (ignores nodes that are gone).
    pub(crate) fn release(&mut self, slots: &[BundleSlot]) {
        for slot in slots {
            if let Some(cap) = self.nodes.get_mut(&slot.node) {
                add(&mut cap.free, &slot.resources);
                cap.free_gpus.extend(&slot.gpus);
                cap.free_gpus.sort_unstable();
            }
        }
    }

    fn explain(&self, bundles: &[Resources], strategy: Strategy) -> String {
        let cluster = sum(&self
            .nodes
            .values()
            .map(|c| c.total.clone())
            .collect::<Vec<_>>());
        let need = sum(bundles);
        let missing: Vec<String> = need
            .iter()
            .filter(|(k, v)| **v > cluster.get(*k).copied().unwrap_or(0.0) + EPS)
            .map(|(k, v)| {
                format!(
                    "{k} (needs {v}, cluster has {})",
                    cluster.get(k).copied().unwrap_or(0.0)
                )
            })
            .collect();
        if !missing.is_empty() {
            return format!("the cluster lacks {}", missing.join(", "));
        }
        for (i, b) in bundles.iter().enumerate() {
            if !self.nodes.values().any(|c| fits(&c.total, b)) {
                return format!("bundle {i} {} fits no single node", show(b));
            }
        }
        let nodes: Vec<String> = self
            .nodes
            .iter()
            .map(|(n, c)| format!("{n} {}", show(&c.total)))
            .collect();
        match strategy {
            Strategy::StrictPack => format!("STRICT_PACK needs {} on one node; nodes: {}", show(&need), nodes.join(", ")),
            Strategy::StrictSpread => format!(
                "STRICT_SPREAD needs {} different nodes that can each hold a bundle; the cluster has {} nodes: {}",
                bundles.len(),
                self.nodes.len(),
                nodes.join(", ")
            ),
            Strategy::NodeBlocks(per_node) => {
                let per_node = (per_node as usize).max(1);
                let block = sum(&bundles[..per_node.min(bundles.len())]);
                let fit: Vec<&String> =
                    self.nodes.iter().filter(|(_, c)| fits(&c.total, &block)).map(|(n, _)| n).collect();
                format!(
                    "{} nodes that can each hold {per_node} bundles {} are needed; the cluster has {} such \
                     node(s) of {}: {}",
                    bundles.len().div_ceil(per_node),
                    show(&block),
                    fit.len(),
                    self.nodes.len(),
                    nodes.join(", ")
                )
            }
            _ => format!("bundles {} do not fit nodes {}", show(&need), nodes.join(", ")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn res(pairs: &[(&str, f64)]) -> Resources {
        pairs.iter().map(|(k, v)| (k.to_string(), *v)).collect()
    }

    fn cluster(n: usize, cpus: f64, gpus: f64) -> Placement {
        let mut p = Placement::default();
        for i in 0..n {
            p.add_node(&format!("node-{i}"), res(&[("CPU", cpus), ("GPU", gpus)]));
        }
        p
    }

    fn nodes(slots: &[BundleSlot]) -> Vec<&str> {
        slots.iter().map(|s| s.node.as_str()).collect()
    }

    #[test]
    fn guarantee_4_strategies_place_as_named() {
        let one = res(&[("CPU", 1.0)]);
        let mut p = cluster(3, 4.0, 0.0);
        let packed = p.reserve(&vec![one.clone(); 3], Strategy::Pack).unwrap();
        assert_eq!(nodes(&packed), ["node-0"; 3]);
        p.release(&packed);
        let spread = p.reserve(&vec![one.clone(); 3], Strategy::Spread).unwrap();
        let mut seen = nodes(&spread);
        seen.sort();
        assert_eq!(seen, ["node-0", "node-1", "node-2"]);
        p.release(&spread);
        let sp = p
            .reserve(&vec![one.clone(); 3], Strategy::StrictSpread)
            .unwrap();
        assert_eq!(
            sp.iter()
                .map(|s| &s.node)
                .collect::<std::collections::BTreeSet<_>>()
                .len(),
            3
        );
        p.release(&sp);
        let sk = p
            .reserve(&vec![one.clone(); 4], Strategy::StrictPack)
            .unwrap();
        assert!(sk.iter().all(|s| s.node == sk[0].node));
        // Pack spills over when one node is not enough; strict pack does not.
        let spill = p.reserve(&vec![one.clone(); 6], Strategy::Pack).unwrap();
        assert_eq!(spill.len(), 6);
        p.release(&spill);
        p.release(&sk);
        assert!(matches!(
            p.reserve(&vec![one; 5], Strategy::StrictPack),
            Err(PlaceError::Infeasible(_))
        ));
    }

    #[test]
    fn guarantee_4_infeasible_names_missing_resources_and_busy_is_distinct() {
        let mut p = cluster(2, 2.0, 1.0);
        let err = p
            .reserve(&[res(&[("GPU", 4.0)])], Strategy::Pack)
            .unwrap_err();
        assert!(
            matches!(&err, PlaceError::Infeasible(m) if m.contains("GPU")),
            "{err}"
        );
        let err = p
            .reserve(&vec![res(&[("CPU", 1.0)]); 3], Strategy::StrictSpread)
            .unwrap_err();
        assert!(
            matches!(&err, PlaceError::Infeasible(m) if m.contains("STRICT_SPREAD")),
            "{err}"
        );
        let err = p
            .reserve(&[res(&[("TPU", 1.0)])], Strategy::Spread)
            .unwrap_err();
        assert!(
            matches!(&err, PlaceError::Infeasible(m) if m.contains("TPU")),
            "{err}"
        );
        let all = p
            .reserve(&vec![res(&[("CPU", 2.0)]); 2], Strategy::Spread)
            .unwrap();
        assert!(matches!(
            p.reserve(&[res(&[("CPU", 1.0)])], Strategy::Pack),
            Err(PlaceError::Busy(_))
        ));
        p.release(&all);
        assert!(p.reserve(&[res(&[("CPU", 1.0)])], Strategy::Pack).is_ok());
    }

    #[test]
    fn guarantee_4_gpu_indices_are_reserved_and_returned() {
        let mut p = cluster(1, 8.0, 4.0);
        let a = p
            .reserve(&vec![res(&[("GPU", 1.0)]); 2], Strategy::Pack)
            .unwrap();
        assert_eq!(
            a.iter().map(|s| s.gpus.clone()).collect::<Vec<_>>(),
            vec![vec![0], vec![1]]
        );
        let b = p.reserve(&[res(&[("GPU", 2.0)])], Strategy::Pack).unwrap();
        assert_eq!(b[0].gpus, vec![2, 3]);
        p.release(&a);
        let c = p.reserve(&[res(&[("GPU", 2.0)])], Strategy::Pack).unwrap();
        assert_eq!(c[0].gpus, vec![0, 1]);
        assert_eq!(p.node("node-0").unwrap().free.get("GPU"), Some(&0.0));
    }

    #[test]
    fn guarantee_4_node_blocks_put_each_block_on_its_own_node() {
        let one = res(&[("CPU", 1.0)]);
        // Pack would put both on one node; --nnodes 2 --nproc-per-node 1 means one on each.
        let mut p = cluster(2, 4.0, 0.0);
        let two = p
            .reserve(&vec![one.clone(); 2], Strategy::NodeBlocks(1))
            .unwrap();
        assert_ne!(two[0].node, two[1].node);
        p.release(&two);
        // 2 blocks of 2: ranks 0-1 share a node, ranks 2-3 share the other.
        let mut p = cluster(3, 2.0, 0.0);
        let four = p
            .reserve(&vec![one.clone(); 4], Strategy::NodeBlocks(2))
            .unwrap();
        let n = nodes(&four);
        assert_eq!((n[0], n[2]), (n[1], n[3]), "{n:?}");
        assert_ne!(n[0], n[2], "{n:?}");
        // A third block of 2 fits only the third node; a fourth block fits nowhere: busy, not infeasible.
        let six = p
            .reserve(&vec![one.clone(); 2], Strategy::NodeBlocks(2))
            .unwrap();
        assert!(six.iter().all(|s| s.node != n[0] && s.node != n[2]));
        assert!(matches!(
            p.reserve(&vec![one.clone(); 2], Strategy::NodeBlocks(2)),
            Err(PlaceError::Busy(_))
        ));
        // Never feasible: 4 nodes of 2 on a 3-node cluster, or blocks larger than any node; the message says so.
        let err = cluster(3, 4.0, 0.0)
            .reserve(&vec![one.clone(); 8], Strategy::NodeBlocks(2))
            .unwrap_err();
        assert!(
            matches!(&err, PlaceError::Infeasible(m) if m.contains("4 nodes that can each hold 2 bundles")
                && m.contains("the cluster has 3 such node(s) of 3")),
            "{err}"
        );
        let err = cluster(3, 2.0, 0.0)
            .reserve(&vec![one; 3], Strategy::NodeBlocks(3))
            .unwrap_err();
        assert!(
            matches!(&err, PlaceError::Infeasible(m) if m.contains("0 such node(s)")),
            "{err}"
        );
    }
}
