//! What the head does when workers and nodes die: restart an actor (on another node when its own is gone), lose the
//! bundles of a dead node, or declare an actor dead for good (guarantees 5, 6 and 12 in `runtime/README.md`). The
//! decisions come from [`super::state::HeadState`]; this module carries them out (events, connections, restarts).

use crate::protocol::Event;

use super::Head;

impl Head {
    /// A node is gone: its bundles are lost, and each of its actors restarts on another node when its budget
    /// allows (guarantee 12), else dies.
    pub(super) fn node_lost(&self, node: &str, reason: &str) {
        let loss = self.lock().node_lost(node, reason);
        let Some(loss) = loss else {
            return;
        };
        self.0.process.conns.forget(loss.addr);
        for e in loss.events {
            self.emit(e);
        }
        for id in loss.restarts {
            self.restart(id);
        }
    }

    /// Re-runs an actor's constructor in a new worker, on another node when its own is gone.
    fn restart(&self, id: u64) {
        let head = self.clone();
        tokio::spawn(async move {
            let moved = head.lock().move_off_dead_node(id);
            match moved {
                Err(why) => return head.declare_dead(id, why),
                Ok(Some(m)) => {
                    tracing::info!(actor = id, r#type = %m.type_name, from = %m.from, to = %m.to, "restarting an actor of a dead node elsewhere");
                }
                Ok(None) => {}
            }
            match head.start_worker(id).await {
                Ok(actor) => head.emit(Event::ActorRestarted { actor }),
                Err(e) => head.worker_exited(id, format!("restart failed: {e:#}")),
            }
        });
    }

    /// Declares an actor dead for good (no restart) and tells everyone.
    fn declare_dead(&self, id: u64, reason: String) {
        let event = self.lock().declare_dead(id, reason);
        if let Some(event) = event {
            self.emit(event);
        }
    }

    /// A worker exited: restart it while its budget allows, else declare it dead.
    pub(super) fn worker_exited(&self, id: u64, reason: String) {
        let exited = self.lock().worker_exited(id, &reason);
        let Some((event, restart)) = exited else {
            return;
        };
        self.emit(event);
        if restart {
            self.restart(id);
        }
    }
}
