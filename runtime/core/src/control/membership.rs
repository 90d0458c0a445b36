//! Node liveness from heartbeats. Pure state: the head records heartbeats with their arrival time and asks which
//! nodes have been silent longer than the bound (guarantee 6 in `runtime/README.md`).

use std::collections::HashMap;
use std::time::{Duration, Instant};

/// Last heartbeat time of every live node.
#[derive(Debug)]
pub(crate) struct Membership {
    bound: Duration,
    last: HashMap<String, Instant>,
}

impl Membership {
    /// Nodes silent for longer than `bound` are declared dead.
    pub(crate) fn new(bound: Duration) -> Self {
        Self {
            bound,
            last: HashMap::new(),
        }
    }
    /// A node joined at `now`.
    pub(crate) fn join(&mut self, node: &str, now: Instant) {
        self.last.insert(node.to_string(), now);
    }
    /// A heartbeat arrived; `false` if the node is unknown (already declared dead).
    pub(crate) fn heartbeat(&mut self, node: &str, now: Instant) -> bool {
        match self.last.get_mut(node) {
            Some(t) => {
                *t = (*t).max(now);
                true
            }
            None => false,
        }
    }
    /// Removes and returns the nodes silent for longer than the bound at `now`.
    pub(crate) fn expire(&mut self, now: Instant) -> Vec<String> {
        let dead: Vec<String> = self
            .last
            .iter()
            .filter(|(_, t)| now.saturating_duration_since(**t) > self.bound)
            .map(|(n, _)| n.clone())
            .collect();
        for n in &dead {
            self.last.remove(n);
        }
        dead
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guarantee_6_silent_nodes_expire_after_the_bound() {
        let t0 = Instant::now();
        let mut m = Membership::new(Duration::from_secs(3));
        m.join("a", t0);
        m.join("b", t0);
        assert!(m.heartbeat("a", t0 + Duration::from_secs(2)));
        assert!(m.expire(t0 + Duration::from_millis(2999)).is_empty());
        assert_eq!(
            m.expire(t0 + Duration::from_millis(3001)),
            vec!["b".to_string()]
        );
        assert!(
            !m.heartbeat("b", t0 + Duration::from_secs(4)),
            "a dead node stays dead"
        );
        assert_eq!(
            m.expire(t0 + Duration::from_millis(5001)),
            vec!["a".to_string()]
        );
    }
}
