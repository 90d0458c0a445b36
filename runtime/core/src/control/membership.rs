//! Node liveness from heartbeats. Pure state: the head records heartbeats with their arrival time and asks which
//! nodes have been silent longer than the bound (guarantee 6 in `runtime/README.md`).
//!
//! Silence is counted in time the head could listen. The head checks every [`Membership::check_period`]; a check
//! that comes late means the head's process was not running (starved of CPU, stopped, swapped out), and heartbeats
//! may be waiting unread in its sockets. That lateness is credited to every node, so a stalled head never declares
//! its nodes dead for the heartbeats it could not read.

use std::collections::HashMap;
use std::time::{Duration, Instant};

/// Last heartbeat time of every live node.
#[derive(Debug)]
pub(crate) struct Membership {
    bound: Duration,
    last: HashMap<String, Instant>,
    /// When the head last checked, to tell a silent node from a head that did not run.
    last_check: Option<Instant>,
}

impl Membership {
    /// Nodes silent for longer than `bound` are declared dead.
    pub(crate) fn new(bound: Duration) -> Self {
        Self {
            bound,
            last: HashMap::new(),
            last_check: None,
        }
    }
    /// How often nodes beat: four beats per bound.
    pub(crate) fn heartbeat_interval(&self) -> Duration {
        self.bound / 4
    }
    /// How often the head checks for silent nodes (a check later than this credits the delay to every node).
    pub(crate) fn check_period(&self) -> Duration {
        (self.bound / 4).max(Duration::from_millis(20))
    }
    /// A node joined at `now`.
    pub(crate) fn join(&mut self, node: &str, now: Instant) {
        self.last.insert(node.to_string(), now);
    }
    /// A node left on purpose: it is no longer watched.
    pub(crate) fn leave(&mut self, node: &str) {
        self.last.remove(node);
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
    /// Removes and returns the nodes silent for longer than the bound at `now`, after crediting every node with
    /// the time this check came later than its period.
    pub(crate) fn expire(&mut self, now: Instant) -> Vec<String> {
        self.credit_head_stall(now);
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
    /// Moves every node's last heartbeat forward by the time since the previous check beyond the check period.
    fn credit_head_stall(&mut self, now: Instant) {
        let stall = self.last_check.map_or(Duration::ZERO, |prev| {
            now.saturating_duration_since(prev)
                .saturating_sub(self.check_period())
        });
        self.last_check = Some(now);
        if stall.is_zero() {
            return;
        }
        if stall > self.check_period() {
            tracing::warn!(
                ?stall,
                "the head checked node liveness late; not counting that time against the nodes"
            );
        }
        for t in self.last.values_mut() {
            *t = (*t + stall).min(now);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BOUND: Duration = Duration::from_secs(3);
    const PERIOD: Duration = Duration::from_millis(750);

    /// Checks every period from `from` (exclusive) to `to` (inclusive) and returns each dead node with the time
    /// of the check that declared it.
    fn check_until(m: &mut Membership, from: Instant, to: Instant) -> Vec<(String, Instant)> {
        let mut dead = Vec::new();
        let mut now = from + PERIOD;
        while now <= to {
            dead.extend(m.expire(now).into_iter().map(|n| (n, now)));
            now += PERIOD;
        }
        dead
    }

    #[test]
    fn guarantee_6_silent_nodes_expire_after_the_bound() {
        let t0 = Instant::now();
        let mut m = Membership::new(BOUND);
        assert_eq!(m.check_period(), PERIOD);
        m.join("a", t0);
        m.join("b", t0);
        assert!(m.expire(t0).is_empty());
        assert!(check_until(&mut m, t0, t0 + PERIOD * 2).is_empty());
        assert!(m.heartbeat("a", t0 + PERIOD * 2));
        assert!(check_until(&mut m, t0 + PERIOD * 2, t0 + PERIOD * 4).is_empty());
        let dead = check_until(&mut m, t0 + PERIOD * 4, t0 + PERIOD * 5);
        assert_eq!(dead, [("b".to_string(), t0 + PERIOD * 5)]);
        assert!(!m.heartbeat("b", t0 + PERIOD * 5), "a dead node stays dead");
        let dead = check_until(&mut m, t0 + PERIOD * 5, t0 + PERIOD * 7);
        assert_eq!(dead, [("a".to_string(), t0 + PERIOD * 7)]);
    }

    #[test]
    fn a_head_that_did_not_run_does_not_count_that_time_against_its_nodes() {
        let t0 = Instant::now();
        let mut m = Membership::new(BOUND);
        m.join("a", t0);
        assert!(m.expire(t0).is_empty());
        assert!(m.heartbeat("a", t0 + PERIOD * 2));
        assert!(check_until(&mut m, t0, t0 + PERIOD * 2).is_empty());
        // The head's process was stopped for 10 s: its next check is that late, and a's heartbeats from that
        // time are still unread. Only the period before the stall counts as silence.
        let woke = t0 + PERIOD * 3 + Duration::from_secs(10);
        assert!(m.expire(woke).is_empty(), "declared dead after a stall");
        // a really is gone: it dies once the head has listened for longer than the bound since a's last heartbeat
        // (one period before the stall, three after it, then the first check beyond).
        let dead = check_until(&mut m, woke, woke + BOUND + PERIOD);
        assert_eq!(dead, [("a".to_string(), woke + PERIOD * 4)]);
    }
}
