//! Drivers and fate-sharing (guarantee 17 in `runtime/README.md`). A driver that joins a running cluster
//! ([`crate::connect`]) registers and beats at the head's rate. When it stops beating for longer than the heartbeat
//! bound (killed by any signal, disconnected, stopped) or says it exits, the head frees what it owns: its resource
//! groups are removed (their actors stop) and its other non-detached actors are killed; a job it published under
//! [`super::JOBS_PREFIX`] that still says `running` then says `failed: driver lost`. Detached actors outlive it, as in
//! Ray. The decisions are pure state ([`Drivers`], [`HeadState::driver_gone`]); [`Head::free_driver`] does the I/O.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::Result;

use super::state::HeadState;
use super::{Head, JOBS_PREFIX};
use crate::actor::{Context, Handler};
use crate::control::membership::Membership;
use crate::control::supervision::Life;
use crate::protocol::{DriverAdmitted, DriverExit, DriverHeartbeat, RegisterDriver};

/// A driver as the head knows it.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct DriverEntry {
    /// Its process id.
    pub(super) pid: u32,
    /// Its host name.
    pub(super) host: String,
    /// Its command line.
    pub(super) command: String,
}

/// The drivers that joined and still beat.
#[derive(Debug)]
pub(super) struct Drivers {
    beats: Membership,
    entries: BTreeMap<u64, DriverEntry>,
    next: u64,
}

impl Drivers {
    /// No drivers; one silent for longer than `bound` is lost.
    pub(super) fn new(bound: Duration) -> Self {
        Self {
            beats: Membership::new(bound),
            entries: BTreeMap::new(),
            next: 0,
        }
    }

    /// A driver registered at `now`: its id (never 0, which means "no driver").
    pub(super) fn register(&mut self, entry: DriverEntry, now: Instant) -> u64 {
        self.next += 1;
        self.beats.join(&self.next.to_string(), now);
        self.entries.insert(self.next, entry);
        self.next
    }

    /// A heartbeat of driver `id` at `now`; `false` when it is unknown or was already declared lost.
    pub(super) fn heartbeat(&mut self, id: u64, now: Instant) -> bool {
        self.beats.heartbeat(&id.to_string(), now)
    }

    /// How often drivers beat.
    pub(super) fn interval(&self) -> Duration {
        self.beats.heartbeat_interval()
    }

    /// The drivers silent for longer than the bound at `now` (each once; pass them to [`HeadState::driver_gone`]).
    pub(super) fn expire(&mut self, now: Instant) -> Vec<u64> {
        let mut lost: Vec<u64> = self
            .beats
            .expire(now)
            .iter()
            .filter_map(|id| id.parse().ok())
            .collect();
        lost.sort_unstable();
        lost
    }

    /// The live drivers, by id.
    pub(super) fn entries(&self) -> &BTreeMap<u64, DriverEntry> {
        &self.entries
    }

    /// The live drivers that are process `pid` on host `host` (a submitted job's driver, when it joined).
    pub(super) fn with_pid(&self, pid: u32, host: &str) -> Vec<u64> {
        self.entries
            .iter()
            .filter(|(_, d)| d.pid == pid && d.host == host)
            .map(|(id, _)| *id)
            .collect()
    }
}

/// What the head frees when a driver goes.
#[derive(Debug, Default, PartialEq)]
pub(super) struct DriverGone {
    /// The driver, if it was still known.
    pub(super) entry: Option<DriverEntry>,
    /// Its resource groups, to remove (their actors stop with them).
    pub(super) groups: Vec<u64>,
    /// Its other non-detached actors still alive or starting, to kill.
    pub(super) actors: Vec<u64>,
}

impl HeadState {
    /// Driver `id` is gone: forgets it and returns what it owned (groups, and non-detached actors outside them).
    pub(super) fn driver_gone(&mut self, id: u64) -> DriverGone {
        let entry = self.drivers.entries.remove(&id);
        self.drivers.beats.leave(&id.to_string());
        let mut groups: Vec<u64> = self
            .groups
            .iter()
            .filter(|(_, g)| g.owner == id)
            .map(|(gid, _)| *gid)
            .collect();
        groups.sort_unstable();
        let mut actors: Vec<u64> = self
            .actors
            .iter()
            .filter(|(_, a)| a.spec.owner == id && !a.spec.detached)
            .filter(|(_, a)| !matches!(a.sup.life, Life::Dead(_)))
            .filter(|(_, a)| a.spec.bundle.is_none_or(|(g, _)| !groups.contains(&g)))
            .map(|(aid, _)| *aid)
            .collect();
        actors.sort_unstable();
        DriverGone {
            entry,
            groups,
            actors,
        }
    }

    /// Every job record under [`JOBS_PREFIX`] that driver `id` published and that still says `running` now says
    /// `state`; returns their keys.
    pub(super) fn fail_jobs_of(&mut self, id: u64, state: &str) -> Vec<String> {
        let mut marked = Vec::new();
        for (key, value) in self.kv.iter_mut() {
            if !key.starts_with(JOBS_PREFIX) {
                continue;
            }
            let Ok(mut job) = serde_json::from_slice::<serde_json::Value>(value) else {
                continue;
            };
            if job["driver"].as_u64() == Some(id) && job["state"] == "running" {
                job["state"] = state.into();
                *value = job.to_string().into_bytes();
                marked.push(key.clone());
            }
        }
        marked.sort();
        marked
    }
}

impl Head {
    /// Frees what driver `id` owned (see the module docs) because of `why`, and marks its running jobs `job_state`.
    pub(super) async fn free_driver(&self, id: u64, why: &str, job_state: &str) {
        let gone = self.lock().driver_gone(id);
        let reason = match &gone.entry {
            Some(d) => format!("driver {id} (pid {} on {}) {why}", d.pid, d.host),
            None => format!("driver {id} {why}"),
        };
        for group in &gone.groups {
            if let Err(e) = self.remove_group(*group, &reason).await {
                tracing::debug!("{reason}: removing group {group}: {e:#}");
            }
        }
        self.stop_actors(&gone.actors, &reason, super::Loudness::Info)
            .await;
        let jobs = self.lock().fail_jobs_of(id, job_state);
        self.0.kv_changed.notify_waiters();
        if gone.groups.is_empty() && gone.actors.is_empty() && jobs.is_empty() {
            tracing::info!("{reason}");
        } else {
            tracing::warn!(
                "{reason}: freed resource groups {:?} and actors {:?}; jobs {jobs:?} marked `{job_state}`",
                gone.groups,
                gone.actors
            );
        }
    }
}

impl Handler<RegisterDriver> for Head {
    async fn handle(&self, m: RegisterDriver, _: &Context) -> Result<DriverAdmitted> {
        let entry = DriverEntry {
            pid: m.pid,
            host: m.host,
            command: m.command,
        };
        let mut st = self.lock();
        let id = st.drivers.register(entry, Instant::now());
        Ok(DriverAdmitted {
            id,
            heartbeat_interval_ms: st.drivers.interval().as_millis().max(1) as u64,
        })
    }
}

impl Handler<DriverHeartbeat> for Head {
    async fn handle(&self, m: DriverHeartbeat, _: &Context) -> Result<bool> {
        Ok(self.lock().drivers.heartbeat(m.id, Instant::now()))
    }
}

impl Handler<DriverExit> for Head {
    async fn handle(&self, m: DriverExit, _: &Context) -> Result<()> {
        self.free_driver(m.id, "exited", "failed: driver exited while running")
            .await;
        Ok(())
    }
}

/// This host's name, as drivers report it in [`RegisterDriver`].
pub(crate) fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_default()
}
