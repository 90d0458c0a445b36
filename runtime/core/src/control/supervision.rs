//! An actor's lifecycle as the head tracks it. Pure state machine: the head applies what happened (started, worker
//! exited, node lost, killed) and acts on the verdict (guarantee 5 in `runtime/README.md`: a worker death restarts
//! the actor while `max_restarts` allows, else the actor is dead for good; a killed actor never restarts). A node's
//! death counts as a worker exit for each of its actors (guarantee 12: they restart on another node).

/// Where an actor is in its life.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Life {
    /// Its worker is being started.
    Starting,
    /// Running.
    Alive,
    /// Its worker died; being restarted (attempt number).
    Restarting(u32),
    /// Gone for good.
    Dead(String),
}

/// What the head must do after a worker exit.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Verdict {
    /// Re-run the constructor (attempt number, 1-based).
    Restart(u32),
    /// Declare it dead with this reason.
    Dead(String),
    /// Nothing: it was already dead or being replaced.
    Ignore,
}

/// Lifecycle plus restart budget of one actor.
#[derive(Debug, Clone)]
pub(crate) struct Supervisor {
    /// Current state.
    pub life: Life,
    max_restarts: u32,
    restarts: u32,
}

impl Supervisor {
    /// A starting actor that may be restarted `max_restarts` times.
    pub(crate) fn new(max_restarts: u32) -> Self {
        Self {
            life: Life::Starting,
            max_restarts,
            restarts: 0,
        }
    }
    /// Its worker is up.
    pub(crate) fn started(&mut self) {
        if !matches!(self.life, Life::Dead(_)) {
            self.life = Life::Alive;
        }
    }
    /// Its worker exited for `reason`.
    pub(crate) fn worker_exited(&mut self, reason: &str) -> Verdict {
        match self.life {
            Life::Dead(_) => Verdict::Ignore,
            _ if self.restarts < self.max_restarts => {
                self.restarts += 1;
                self.life = Life::Restarting(self.restarts);
                Verdict::Restart(self.restarts)
            }
            _ => {
                let why = if self.max_restarts > 0 {
                    format!(
                        "{reason} (after {} restarts, max_restarts = {})",
                        self.restarts, self.max_restarts
                    )
                } else {
                    reason.to_string()
                };
                self.life = Life::Dead(why.clone());
                Verdict::Dead(why)
            }
        }
    }
    /// Killed on purpose, or its group or bundle is gone: dead without restart. `false` if it was already dead.
    pub(crate) fn kill(&mut self, reason: &str) -> bool {
        if matches!(self.life, Life::Dead(_)) {
            return false;
        }
        self.life = Life::Dead(reason.to_string());
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guarantee_5_restarts_until_budget_then_dies() {
        let mut s = Supervisor::new(2);
        s.started();
        assert_eq!(s.worker_exited("SIGKILL"), Verdict::Restart(1));
        s.started();
        assert_eq!(s.worker_exited("SIGKILL"), Verdict::Restart(2));
        s.started();
        assert!(
            matches!(s.worker_exited("SIGKILL"), Verdict::Dead(r) if r.contains("max_restarts = 2"))
        );
        assert_eq!(s.worker_exited("again"), Verdict::Ignore);
    }

    #[test]
    fn guarantee_5_killed_actors_never_restart() {
        let mut s = Supervisor::new(5);
        s.started();
        assert!(s.kill("killed by driver"));
        assert_eq!(s.worker_exited("SIGKILL"), Verdict::Ignore);
        assert!(!s.kill("again"));
        assert_eq!(s.life, Life::Dead("killed by driver".into()));
    }
}
