//! The data loader: tokenizes the training (and validation) files once, then hands out the global batches the run
//! loop names (by training-set index), each split contiguously across the data-parallel ranks. The order of batches
//! is the loop's ([`ferl_data::DataPlan`]): it depends only on the dataset, `data.train_batch_size`, `trainer.seed`
//! and `data.shuffle`, never on the number of ranks.

use anyhow::{Context as _, Result};
use ferl_config::SftConfig;
use ferl_data::{rank_shard, steps_per_epoch, Batching, RankMicroBatches, SftDataset};
use ferl_plugin_bridge::plugin_dataset;
use ferl_plugin_host::PluginHost;
use ferl_runtime::{Actor, Context, Handler};

use crate::messages::*;
use crate::rank::resolve_model_dir;
use ferl_trainer::run::RankLayout;

/// Splits `indices` of `dataset` contiguously over `world` ranks, as wire samples.
pub fn split_samples(dataset: &SftDataset, indices: &[usize], world: usize) -> Vec<Vec<Sample>> {
    (0..world)
        .map(|r| {
            rank_shard(indices, r, world)
                .iter()
                .map(|&i| Sample::from(dataset.get(i)))
                .collect()
        })
        .collect()
}

/// The micro-batches of every rank for the global batch `indices` of `dataset`, as `batching` plans them.
pub fn plan_batch(
    dataset: &SftDataset,
    indices: &[usize],
    world: usize,
    batching: Batching,
) -> Result<Vec<RankMicroBatches>> {
    let lengths: Vec<usize> = indices.iter().map(|&i| dataset.get(i).len()).collect();
    batching.plan(indices, &lengths, world)
}

/// One rank's share of the global batch `indices` of `dataset` in its planned micro-batches `micro`: the samples,
/// micro-batch after micro-batch, and the size of each micro-batch.
pub fn rank_share(
    dataset: &SftDataset,
    indices: &[usize],
    micro: &RankMicroBatches,
) -> (Vec<Sample>, Vec<u64>) {
    let samples = micro
        .iter()
        .flatten()
        .map(|&p| Sample::from(dataset.get(indices[p])))
        .collect();
    (samples, micro.iter().map(|m| m.len() as u64).collect())
}

/// Every rank's share of the global batch `indices` of `dataset` ([`plan_batch`], [`rank_share`]).
pub fn plan_shares(
    dataset: &SftDataset,
    indices: &[usize],
    world: usize,
    batching: Batching,
) -> Result<Vec<(Vec<Sample>, Vec<u64>)>> {
    let plan = plan_batch(dataset, indices, world, batching)?;
    Ok(plan
        .iter()
        .map(|m| rank_share(dataset, indices, m))
        .collect())
}

/// Validation runs in at most this many calls of whole micro-batch rounds, so that its rows are reported as it goes.
pub const VALIDATION_CALLS: usize = 64;

/// The calls of a validation of `rounds` micro-batch rounds (every rank runs the same rounds): consecutive ranges of
/// rounds, at most [`VALIDATION_CALLS`] of them.
pub fn validation_calls(rounds: usize) -> Vec<std::ops::Range<usize>> {
    let per = rounds.div_ceil(VALIDATION_CALLS).max(1);
    (0..rounds)
        .step_by(per)
        .map(|a| a..(a + per).min(rounds))
        .collect()
}

/// The samples of a rank's `shard` that the rounds `call` of `micro` samples each take (fewer, or none, at its end).
pub fn call_samples<'a, T>(shard: &'a [T], call: &std::ops::Range<usize>, micro: usize) -> &'a [T] {
    let micro = micro.max(1);
    let end = (call.end * micro).min(shard.len());
    &shard[(call.start * micro).min(end)..end]
}

/// The validation rows of `len` reported done after `rounds_done` of `rounds` rounds.
pub fn rows_done(len: usize, rounds_done: usize, rounds: usize) -> u64 {
    (len * rounds_done / rounds.max(1)) as u64
}

/// Loads the training set (and the validation set when files are given: the last step always validates); with
/// `data.plugin` set, through that dataset plugin of this process's plugin host
/// ([`crate::plugins::actor_plugin_host`]: the plugins shipped to this worker, else `$FERL_PLUGIN_PATH`).
pub fn load_datasets(cfg: &SftConfig) -> Result<(SftDataset, Option<SftDataset>)> {
    let host = match &cfg.data.plugin {
        Some(name) => Some(crate::plugins::actor_plugin_host()?.with_context(|| {
            format!("data.plugin={name}: no plugin was shipped to this process and $FERL_PLUGIN_PATH is not set")
        })?),
        None => None,
    };
    load_datasets_with(cfg, host.as_deref())
}

/// [`load_datasets`] with the dataset plugin (when `data.plugin` is set) taken from `host`.
pub fn load_datasets_with(
    cfg: &SftConfig,
    host: Option<&PluginHost>,
) -> Result<(SftDataset, Option<SftDataset>)> {
    let dir = resolve_model_dir(cfg)?;
    let with_val = !cfg.data.val_files.as_slice().is_empty();
    let d = &cfg.data;
    if let Some(name) = &d.plugin {
        let host = host.with_context(|| {
            format!("data.plugin={name}: this process has no plugin host (no plugin shipped, no $FERL_PLUGIN_PATH)")
        })?;
        let load = |files: &[String], max: i64| {
            plugin_dataset(host, d, files, &dir, max).with_context(|| format!("data.plugin={name}"))
        };
        let train = load(d.train_files.as_slice(), d.train_max_samples)
            .context("loading data.train_files")?;
        let val = if with_val {
            Some(
                load(d.val_files.as_slice(), d.val_max_samples)
                    .context("loading data.val_files")?,
            )
        } else {
            None
        };
        return Ok((train, val));
    }
    let train = SftDataset::train(d, &dir).context("loading data.train_files")?;
    let val = if with_val {
        Some(SftDataset::val(d, &dir).context("loading data.val_files")?)
    } else {
        None
    };
    Ok((train, val))
}

/// Constructor arguments of [`DataLoader`].
#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Debug, Clone)]
pub struct DataLoaderArgs {
    /// The resolved config as YAML.
    pub config_yaml: String,
    /// Trainer ranks: each batch is split over their data-parallel groups (`ulysses_sequence_parallel_size`
    /// ranks share one share) and every rank gets its group's share.
    pub world_size: u64,
}

/// The data-loader actor.
pub struct DataLoader {
    train: SftDataset,
    val: Option<SftDataset>,
    ranks: RankLayout,
    batch: usize,
    batching: Batching,
}

impl Actor for DataLoader {
    type Args = DataLoaderArgs;
    const NAME: &'static str = "ferl.actors.DataLoader";
    async fn start(args: DataLoaderArgs, _: &Context) -> Result<Self> {
        let cfg = SftConfig::from_yaml(&args.config_yaml, &[])
            .context("data loader: reading the config")?;
        let batch = cfg.data.train_batch_size;
        let batching = Batching::from_config(&cfg);
        let ranks = RankLayout::new(&cfg, (args.world_size as usize).max(1))?;
        let (train, val) = tokio::task::spawn_blocking(move || load_datasets(&cfg))
            .await
            .context("data loader: tokenizing task")??;
        Ok(Self {
            train,
            val,
            ranks,
            batch,
            batching,
        })
    }
}

impl Handler<GetDatasetInfo> for DataLoader {
    async fn handle(&self, _: GetDatasetInfo, _: &Context) -> Result<DatasetInfo> {
        Ok(DatasetInfo {
            train_len: self.train.len() as u64,
            val_len: self.val.as_ref().map_or(0, |v| v.len() as u64),
            steps_per_epoch: steps_per_epoch(self.train.len(), self.batch) as u64,
        })
    }
}

impl Handler<BatchOf> for DataLoader {
    async fn handle(&self, m: BatchOf, _: &Context) -> Result<GlobalBatch> {
        let indices: Vec<usize> = m.indices.iter().map(|&i| i as usize).collect();
        if let Some(&bad) = indices.iter().find(|&&i| i >= self.train.len()) {
            anyhow::bail!(
                "batch index {bad} is past the training set ({} samples)",
                self.train.len()
            );
        }
        let dp_world = self.ranks.dp_world();
        let shares = plan_shares(&self.train, &indices, dp_world, self.batching)?;
        let (shards, micro_sizes): (Vec<_>, Vec<_>) = shares.into_iter().unzip();
        let global_targets = shards.iter().flatten().map(Sample::num_targets).sum();
        let tokens = shards
            .iter()
            .flatten()
            .map(|s| s.input_ids.len() as i64)
            .sum();
        Ok(GlobalBatch {
            shards: self.ranks.per_rank(shards),
            micro_sizes: self.ranks.per_rank(micro_sizes),
            global_targets,
            tokens,
        })
    }
}

impl Handler<ValShards> for DataLoader {
    async fn handle(&self, _: ValShards, _: &Context) -> Result<Vec<Vec<Sample>>> {
        let Some(val) = &self.val else {
            return Ok(vec![Vec::new(); self.ranks.world]);
        };
        let all: Vec<usize> = (0..val.len()).collect();
        let shards = split_samples(val, &all, self.ranks.dp_world());
        Ok(self.ranks.per_rank(shards))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validation_calls_cover_every_round_once_in_at_most_64_calls() {
        for rounds in [0, 1, 5, 64, 65, 330, 1000] {
            let calls = validation_calls(rounds);
            assert!(
                calls.len() <= VALIDATION_CALLS,
                "{rounds}: {} calls",
                calls.len()
            );
            let covered: Vec<usize> = calls.iter().flat_map(|c| c.clone()).collect();
            assert_eq!(covered, (0..rounds).collect::<Vec<_>>(), "{rounds} rounds");
        }
        assert_eq!(validation_calls(5), [0..1, 1..2, 2..3, 3..4, 4..5]);
        assert_eq!(
            validation_calls(130),
            (0..130)
                .step_by(3)
                .map(|a| a..(a + 3).min(130))
                .collect::<Vec<_>>()
        );
    }

    #[test]
    fn call_samples_take_each_rounds_micro_batches_and_run_dry_at_the_shards_end() {
        let shard: Vec<u32> = (0..7).collect();
        assert_eq!(call_samples(&shard, &(0..2), 2), [0, 1, 2, 3]);
        assert_eq!(call_samples(&shard, &(2..3), 2), [4, 5]);
        assert_eq!(call_samples(&shard, &(3..5), 2), [6]);
        assert!(call_samples(&shard, &(5..6), 2).is_empty());
        assert_eq!(rows_done(1319, 165, 330), 659);
        assert_eq!(rows_done(1319, 330, 330), 1319);
        assert_eq!(rows_done(0, 0, 0), 0);
    }
}
