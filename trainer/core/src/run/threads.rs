//! Intra-op threads per rank, as torchrun means them: the ranks that share a host split its cores between them,
//! unless `OMP_NUM_THREADS` says otherwise. Without this every rank of `--nproc-per-node N` would start torch's
//! default pool of one thread per core, and N ranks would oversubscribe the host N times over.
//!
//! Every launch path calls [`set_rank_threads`] once per rank process, with the number of ranks on its host: the
//! head's `LOCAL_WORLD_SIZE` for actor ranks, torchrun's `LOCAL_WORLD_SIZE` or SLURM's tasks per node for launched
//! ranks ([`local_ranks_from_env`]), 1 for one process.

use anyhow::{bail, Result};

/// The environment variable that, when set, fixes every rank's intra-op threads (as for torch and torchrun).
pub const OMP_NUM_THREADS: &str = "OMP_NUM_THREADS";

/// How many intra-op threads a rank uses, and what decided it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ThreadChoice {
    /// Threads of torch's intra-op pool in this rank.
    pub threads: usize,
    /// Cores this process may run on.
    pub cores: usize,
    /// Ranks on this host (this one included).
    pub local_ranks: usize,
    /// `OMP_NUM_THREADS`, when it was set and decided.
    pub from_env: Option<usize>,
}

impl ThreadChoice {
    /// `cores / local_ranks` (at least 1), unless `omp` (the value of `OMP_NUM_THREADS`) is set; an `omp` that is
    /// not a positive whole number is refused naming the variable.
    pub fn new(cores: usize, local_ranks: usize, omp: Option<&str>) -> Result<Self> {
        let local_ranks = local_ranks.max(1);
        let cores = cores.max(1);
        let from_env = match omp.map(str::trim) {
            None | Some("") => None,
            Some(v) => match v.parse::<usize>() {
                Ok(n) if n > 0 => Some(n),
                _ => bail!("{OMP_NUM_THREADS}={v:?}: expected a positive whole number of threads"),
            },
        };
        Ok(Self {
            threads: from_env.unwrap_or((cores / local_ranks).max(1)),
            cores,
            local_ranks,
            from_env,
        })
    }

    /// The choice for this process: its available cores (affinity and cgroup limits counted) and
    /// `OMP_NUM_THREADS` from the environment.
    pub fn for_this_process(local_ranks: usize) -> Result<Self> {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let omp = std::env::var(OMP_NUM_THREADS).ok();
        Self::new(cores, local_ranks, omp.as_deref())
    }

    /// One line saying what was chosen and why, e.g. `1 intra-op thread per rank (2 cores / 2 ranks on its host;
    /// set OMP_NUM_THREADS to choose)`.
    pub fn describe(&self) -> String {
        let plural = if self.threads == 1 { "" } else { "s" };
        let ranks = match self.local_ranks {
            1 => "1 rank".to_string(),
            n => format!("{n} ranks"),
        };
        match self.from_env {
            Some(_) => format!(
                "{} intra-op thread{plural} per rank ({OMP_NUM_THREADS}={}; {} cores, {ranks} on its host)",
                self.threads, self.threads, self.cores
            ),
            None => format!(
                "{} intra-op thread{plural} per rank ({} cores / {ranks} on its host; set {OMP_NUM_THREADS} to \
                 choose)",
                self.threads, self.cores
            ),
        }
    }
}

/// Chooses this rank's intra-op threads for `local_ranks` ranks on its host and sets torch's pool to it.
pub fn set_rank_threads(local_ranks: usize) -> Result<ThreadChoice> {
    let choice = ThreadChoice::for_this_process(local_ranks)?;
    tch::set_num_threads(choice.threads as i32);
    Ok(choice)
}

/// Ranks on this host from a launcher's environment read through `get`: `LOCAL_WORLD_SIZE` (torchrun, and the
/// head for actor ranks), else SLURM's `SLURM_NTASKS_PER_NODE`, else the first count of `SLURM_TASKS_PER_NODE`
/// (`2(x3)` is 2 tasks on each of 3 nodes), else 1.
pub fn local_ranks_from(get: impl Fn(&str) -> Option<String>) -> usize {
    let leading = |v: String| -> Option<usize> {
        let digits: String = v.trim().chars().take_while(char::is_ascii_digit).collect();
        digits.parse().ok().filter(|n| *n > 0)
    };
    [
        "LOCAL_WORLD_SIZE",
        "SLURM_NTASKS_PER_NODE",
        "SLURM_TASKS_PER_NODE",
    ]
    .iter()
    .find_map(|k| get(k).and_then(leading))
    .unwrap_or(1)
}

/// [`local_ranks_from`] the process environment.
pub fn local_ranks_from_env() -> usize {
    local_ranks_from(|k| std::env::var(k).ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_split_the_cores_of_their_host_unless_omp_num_threads_is_set() {
        let c = ThreadChoice::new(16, 4, None).unwrap();
        assert_eq!((c.threads, c.from_env), (4, None));
        assert_eq!(ThreadChoice::new(2, 2, None).unwrap().threads, 1);
        assert_eq!(ThreadChoice::new(2, 3, None).unwrap().threads, 1, "never 0");
        assert_eq!(ThreadChoice::new(7, 2, None).unwrap().threads, 3);
        assert_eq!(ThreadChoice::new(8, 1, Some("")).unwrap().threads, 8);
        let set = ThreadChoice::new(16, 4, Some("2")).unwrap();
        assert_eq!((set.threads, set.from_env), (2, Some(2)));
        assert!(
            set.describe().contains("OMP_NUM_THREADS=2"),
            "{}",
            set.describe()
        );
        let line = ThreadChoice::new(2, 2, None).unwrap().describe();
        assert_eq!(
            line,
            "1 intra-op thread per rank (2 cores / 2 ranks on its host; set OMP_NUM_THREADS to choose)"
        );
        for bad in ["0", "two", "-1"] {
            let err = ThreadChoice::new(4, 1, Some(bad)).unwrap_err().to_string();
            assert!(err.contains("OMP_NUM_THREADS"), "{err}");
        }
    }

    #[test]
    fn ranks_per_host_come_from_torchrun_or_slurm() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| {
                pairs
                    .iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| v.to_string())
            }
        };
        assert_eq!(local_ranks_from(env(&[("LOCAL_WORLD_SIZE", "4")])), 4);
        assert_eq!(local_ranks_from(env(&[("SLURM_NTASKS_PER_NODE", "8")])), 8);
        assert_eq!(
            local_ranks_from(env(&[("SLURM_TASKS_PER_NODE", "2(x3)")])),
            2
        );
        assert_eq!(
            local_ranks_from(env(&[
                ("LOCAL_WORLD_SIZE", "3"),
                ("SLURM_NTASKS_PER_NODE", "8")
            ])),
            3,
            "torchrun's name wins"
        );
        assert_eq!(local_ranks_from(env(&[])), 1);
        assert_eq!(local_ranks_from(env(&[("LOCAL_WORLD_SIZE", "0")])), 1);
    }
}
