//! How ranks divide a run's work: data parallelism over groups of `ulysses_sequence_parallel_size` consecutive
//! ranks that share each sequence (`model::ulysses`). Ranks `g·K .. (g+1)·K` form sequence-parallel group `g`, which
//! is data-parallel rank `g` of `world / K`: its ranks train the same samples, each on `1/K` of every sequence.
//! Parameters are sharded over all `world` ranks as before; their gradient reduction sums every rank's tokens.

use anyhow::{bail, Result};
use ferl_config::SftConfig;

/// The data- and sequence-parallel layout of `world` ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RankLayout {
    /// Ranks sharing each sequence (`K`, 1 without sequence parallelism).
    pub sp_size: usize,
    /// All ranks.
    pub world: usize,
}

impl RankLayout {
    /// The layout `cfg` asks of `world` ranks; refused when `ulysses_sequence_parallel_size` does not divide it.
    pub fn new(cfg: &SftConfig, world: usize) -> Result<Self> {
        let k = cfg.ulysses_sequence_parallel_size;
        if k == 0 || world == 0 || !world.is_multiple_of(k) {
            bail!(
                "ulysses_sequence_parallel_size={k} must divide the number of ranks ({world}): each group of {k} \
                 ranks shares every sequence"
            );
        }
        Ok(Self { sp_size: k, world })
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
    fn a_size_that_does_not_divide_the_ranks_is_refused_naming_both() {
        let err = RankLayout::new(&cfg(2), 3).unwrap_err().to_string();
        assert!(
            err.contains("ulysses_sequence_parallel_size=2") && err.contains("(3)"),
            "{err}"
        );
        assert!(RankLayout::new(&cfg(4), 1).is_err());
    }
}
