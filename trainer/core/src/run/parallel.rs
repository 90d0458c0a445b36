//! How ranks divide a run's work: data parallelism over groups of `ulysses_sequence_parallel_size` consecutive
//! ranks that share each sequence (`model::ulysses`). Ranks `g·K .. (g+1)·K` form sequence-parallel group `g`, which
//! is data-parallel rank `g` of `world / K`: its ranks train the same samples, each on `1/K` of every sequence.
//! Parameters are sharded over all `world` ranks as before; their gradient reduction sums every rank's tokens.
//!
//! HSDP (`model.fsdp_config.fsdp_size=S`, `1 < S < world`, `S` dividing `world`) shards parameters within groups of
//! `S` consecutive ranks instead (ranks `g·S .. (g+1)·S` form shard group `g`) and replicates them across the groups
//! (replica group `r`: ranks `r, r+S, r+2S, ...`), FSDP2's mesh `[replicate, shard]`. It changes only where
//! parameters live: data parallelism and the token-mean loss are the same, so the two sizes are independent.

use anyhow::{bail, Result};
use ferl_config::SftConfig;

/// The data- and sequence-parallel layout of `world` ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RankLayout {
    /// Ranks sharing each sequence (`K`, 1 without sequence parallelism).
    pub sp_size: usize,
    /// All ranks.
    pub world: usize,
    /// Ranks one copy of the parameters is sharded over: `fsdp_size` under HSDP, else `world`.
    pub shard_size: usize,
}

impl RankLayout {
    /// The layout `cfg` asks of `world` ranks; refused when `ulysses_sequence_parallel_size` or
    /// `model.fsdp_config.fsdp_size` (other than -1 and 1) does not divide it.
    pub fn new(cfg: &SftConfig, world: usize) -> Result<Self> {
        let k = cfg.ulysses_sequence_parallel_size;
        if k == 0 || world == 0 || !world.is_multiple_of(k) {
            // The same words on every launch path, whatever its number of ranks, as the config gate promises.
            bail!(
                "ulysses_sequence_parallel_size={k} must divide the run's number of ranks: each group of {k} ranks \
                 shares every sequence"
            );
        }
        let s = cfg.model.fsdp_config.fsdp_size;
        let shard_size = match s {
            -1 | 1 => world,
            s if s > 1 && world.is_multiple_of(s as usize) => s as usize,
            // The same words on every launch path, whatever its number of ranks, as the config gate promises.
            _ => bail!(
                "model.fsdp_config.fsdp_size={s} must divide the run's number of ranks: HSDP shards the model \
                 within groups of fsdp_size consecutive ranks and replicates it across the groups (use a divisor \
                 of the ranks, -1 to shard over all of them, or 1 for NO_SHARD)"
            ),
        };
        Ok(Self {
            sp_size: k,
            world,
            shard_size,
        })
    }

    /// Whether parameters are sharded within groups and replicated across them (HSDP).
    pub fn hybrid(&self) -> bool {
        self.shard_size < self.world
    }

    /// The shard group of `rank` (its replica index).
    pub fn shard_group(&self, rank: usize) -> usize {
        rank / self.shard_size
    }

    /// `rank`'s place in its shard group (its replica group's index).
    pub fn shard_rank(&self, rank: usize) -> usize {
        rank % self.shard_size
    }

    /// Number of shard groups (copies of the parameters).
    pub fn replicas(&self) -> usize {
        self.world / self.shard_size
    }

    /// Data-parallel ranks (sequence-parallel groups).
    pub fn dp_world(&self) -> usize {
        self.world / self.sp_size
    }

    /// The data-parallel rank (group) of `rank`.
    pub fn dp_rank(&self, rank: usize) -> usize {
        rank / self.sp_size
    }

    /// `rank`'s place in its sequence-parallel group.
    pub fn sp_rank(&self, rank: usize) -> usize {
        rank % self.sp_size
    }

    /// Items per data-parallel rank (`dp_world` of them) as items per rank: each repeated for its group's ranks.
    pub fn per_rank<T: Clone>(&self, per_dp: Vec<T>) -> Vec<T> {
        per_dp
            .into_iter()
            .flat_map(|x| std::iter::repeat_n(x, self.sp_size))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(k: usize) -> SftConfig {
        SftConfig::load(None, &[format!("ulysses_sequence_parallel_size={k}")]).unwrap()
    }

    #[test]
    fn groups_are_consecutive_ranks_and_share_their_data() {
        let l = RankLayout::new(&cfg(2), 4).unwrap();
        assert_eq!(l.dp_world(), 2);
        assert_eq!(
            (0..4).map(|r| l.dp_rank(r)).collect::<Vec<_>>(),
            [0, 0, 1, 1]
        );
        assert_eq!(
            (0..4).map(|r| l.sp_rank(r)).collect::<Vec<_>>(),
            [0, 1, 0, 1]
        );
        assert_eq!(l.per_rank(vec!["a", "b"]), ["a", "a", "b", "b"]);
        assert_eq!(
            RankLayout::new(&cfg(1), 3).unwrap().per_rank(vec![1, 2, 3]),
            [1, 2, 3]
        );
    }

    #[test]
    fn hsdp_groups_are_consecutive_shard_groups_and_strided_replica_groups() {
        let cfg = |s: i64, k: usize| {
            SftConfig::load(
                None,
                &[
                    format!("model.fsdp_config.fsdp_size={s}"),
                    format!("ulysses_sequence_parallel_size={k}"),
                ],
            )
            .unwrap()
        };
        let l = RankLayout::new(&cfg(2, 1), 4).unwrap();
        assert!(l.hybrid());
        assert_eq!(l.replicas(), 2);
        let groups: Vec<_> = (0..4)
            .map(|r| (l.shard_group(r), l.shard_rank(r)))
            .collect();
        assert_eq!(groups, [(0, 0), (0, 1), (1, 0), (1, 1)]);
        assert_eq!(l.dp_world(), 4, "data parallelism stays over every rank");
        let both = RankLayout::new(&cfg(2, 2), 4).unwrap();
        assert_eq!((both.dp_world(), both.replicas()), (2, 2));
        for s in [-1, 1, 4] {
            assert!(!RankLayout::new(&cfg(s, 1), 4).unwrap().hybrid(), "{s}");
        }
        for (s, world) in [(3, 4), (4, 2), (0, 2), (-2, 2), (2, 1)] {
            let err = RankLayout::new(&cfg(s, 1), world).unwrap_err().to_string();
            let want =
                format!("model.fsdp_config.fsdp_size={s} must divide the run's number of ranks");
            assert!(err.contains(&want), "{err}");
        }
    }

    #[test]
    fn a_size_that_does_not_divide_the_ranks_is_refused_naming_the_key() {
        let err = RankLayout::new(&cfg(2), 3).unwrap_err().to_string();
        assert!(
            err.contains("ulysses_sequence_parallel_size=2") && err.contains("number of ranks"),
            "{err}"
        );
        assert!(RankLayout::new(&cfg(4), 1).is_err());
    }
}
