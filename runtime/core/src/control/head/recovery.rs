//! What the head does when workers and nodes die: restart an actor (on another node when its own is gone), lose the
//! bundles of a dead node, or declare an actor dead for good (guarantees 5, 6 and 12 in `runtime/README.md`). The
//! decisions come from [`crate::control::supervision`]; this module applies them to the head's state.

use crate::control::supervision::{Life, Verdict};
use crate::protocol::{Event, Strategy};

use super::{forget_actor, gpu_env, least_loaded, show, Head};

impl Head {
    /// A node is gone: its bundles are lost, and each of its actors restarts on another node when its budget
    /// allows (guarantee 12), else dies.
    pub(super) fn node_lost(&self, node: &str, reason: &str) {
        let (events, restarts, addr) = {
            let mut st = self.lock();
            let Some(entry) = st.nodes.get_mut(node) else {
                return;
            };
            if !entry.alive {
                return;
            }
            entry.alive = false;
            let addr = entry.addr;
            st.placement.remove_node(node);
            for (gid, g) in st.groups.iter_mut() {
                for (b, slot) in g.slots.iter().enumerate() {
                    if slot.node == node {
                        g.lost.insert(
                            b,
                            format!("bundle {b} of resource group {gid} was on node {node}, which died ({reason})"),
                        );
                    }
                }
            }
            let on_node: Vec<u64> = st
                .actors
                .iter()
                .filter(|(_, a)| a.node == node)
                .map(|(id, _)| *id)
                .collect();
            let (mut events, mut restarts) = (Vec::new(), Vec::new());
            for id in on_node {
                let a = st.actors.get_mut(&id).expect("listed above");
                let verdict = match (&a.sup.life, a.spec.bundle) {
                    // A start in flight fails when the connection to the node closes, and takes the restart path.
                    (Life::Dead(_) | Life::Starting | Life::Restarting(_), _) => Verdict::Ignore,
                    (Life::Alive, Some((group, bundle))) => {
                        let why = lost_bundle_reason(group, bundle, node, reason);
                        a.sup.kill(&why);
                        Verdict::Dead(why)
                    }
                    (Life::Alive, None) => a.sup.worker_exited(reason),
                };
                match verdict {
                    Verdict::Restart(attempt) => {
                        events.push(Event::ActorRestarting {
                            id,
                            node: node.into(),
                            reason: reason.into(),
                            attempt,
                        });
                        restarts.push(id);
                    }
                    Verdict::Dead(why) => {
                        events.push(Event::ActorDied {
                            id,
                            type_name: a.spec.type_name.clone(),
                            node: node.into(),
                            reason: why,
                        });
                        forget_actor(&mut st, id);
                    }
                    Verdict::Ignore => {}
                }
            }
            (events, restarts, addr)
        };
        self.0.process.conns.forget(addr);
        for e in events {
            self.emit(e);
        }
        self.emit(Event::NodeDied {
            node: node.into(),
            reason: reason.into(),
        });
        for id in restarts {
            self.restart(id);
        }
    }

    /// Re-runs an actor's constructor in a new worker, on another node when its own is gone.
    fn restart(&self, id: u64) {
        let head = self.clone();
        tokio::spawn(async move {
            if let Err(why) = head.move_off_dead_node(id) {
                return head.declare_dead(id, why);
            }
            match head.start_worker(id).await {
                Ok(actor) => head.emit(Event::ActorRestarted { actor }),
                Err(e) => head.worker_exited(id, format!("restart failed: {e:#}")),
            }
        });
    }

    /// Chooses a live node for an actor whose node died: one with the resources it reserved, or the least loaded
    /// one when it reserved none. An actor of a resource-group bundle cannot move (its bundle is lost).
    fn move_off_dead_node(&self, id: u64) -> Result<(), String> {
        let mut st = self.lock();
        let Some(a) = st.actors.get(&id) else {
            return Ok(());
        };
        if st.nodes.get(&a.node).is_some_and(|n| n.alive) {
            return Ok(());
        }
        let (old, type_name) = (a.node.clone(), a.spec.type_name.clone());
        if let Some((group, bundle)) = a.spec.bundle {
            return Err(lost_bundle_reason(
                group,
                bundle,
                &old,
                "it cannot restart elsewhere",
            ));
        }
        let need = a.spec.resources.clone();
        let (node, own, env) = if need.values().any(|v| *v > 0.0) {
            match st
                .placement
                .reserve(std::slice::from_ref(&need), Strategy::Pack)
            {
                Ok(mut slots) => {
                    let slot = slots.remove(0);
                    let env = gpu_env(&slot);
                    (slot.node.clone(), Some(slot), env)
                }
                Err(e) => {
                    return Err(format!(
                        "its node {old} died and no live node can host it ({}): {e}",
                        show(&need)
                    ))
                }
            }
        } else {
            let node = least_loaded(&st)
                .ok_or_else(|| format!("its node {old} died and no live node is left"))?;
            (node, None, Vec::new())
        };
        tracing::info!(actor = id, r#type = %type_name, from = %old, to = %node, "restarting an actor of a dead node elsewhere");
        let a = st.actors.get_mut(&id).expect("looked up above");
        a.node = node;
        a.own = own;
        a.env = env;
        a.addr = String::new();
        Ok(())
    }

    /// Declares an actor dead for good (no restart) and tells everyone.
    fn declare_dead(&self, id: u64, reason: String) {
        let event = {
            let mut st = self.lock();
            let Some(a) = st.actors.get_mut(&id) else {
                return;
            };
            if !a.sup.kill(&reason) {
                return;
            }
            let ev = Event::ActorDied {
                id,
                type_name: a.spec.type_name.clone(),
                node: a.node.clone(),
                reason,
            };
            forget_actor(&mut st, id);
            ev
        };
        self.emit(event);
    }

    /// A worker exited: restart it while its budget allows, else declare it dead.
    pub(super) fn worker_exited(&self, id: u64, reason: String) {
        let verdict = {
            let mut st = self.lock();
            let Some(a) = st.actors.get_mut(&id) else {
                return;
            };
            let v = a.sup.worker_exited(&reason);
            let ev = match &v {
                Verdict::Restart(attempt) => Some(Event::ActorRestarting {
                    id,
                    node: a.node.clone(),
                    reason: reason.clone(),
                    attempt: *attempt,
                }),
                Verdict::Dead(why) => Some(Event::ActorDied {
                    id,
                    type_name: a.spec.type_name.clone(),
                    node: a.node.clone(),
                    reason: why.clone(),
                }),
                Verdict::Ignore => None,
            };
            if matches!(v, Verdict::Dead(_)) {
                forget_actor(&mut st, id);
            }
            ev
        };
        let Some(event) = verdict else { return };
        let restart = matches!(event, Event::ActorRestarting { .. });
        self.emit(event);
        if restart {
            self.restart(id);
        }
    }
}

/// Why an actor of bundle `bundle` in `group` cannot live on: the bundle's node died.
fn lost_bundle_reason(group: u64, bundle: u32, node: &str, reason: &str) -> String {
    format!(
        "bundle {bundle} of resource group {group} was lost with node {node} ({reason}); an actor placed in a \
         bundle is not moved to another node: remove the group and create it again"
    )
}
