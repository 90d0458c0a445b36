//! The data loader: tokenizes the training (and validation) files once, then hands out global batches in the seeded
//! epoch order, each split contiguously across the data-parallel ranks, and remembers its position for resume.
//!
//! Invariants:
//! 1. The sequence of global batches depends only on (dataset, `data.train_batch_size`, `trainer.seed`,
//!    `data.shuffle`) — never on the number of ranks; ranks only change how each batch is split.
//! 2. After the last whole batch of an epoch the position moves to step 0 of the next epoch, so a checkpoint taken
//!    at an epoch boundary resumes at the next epoch (verl #7401 resumes into nothing).

use std::sync::Mutex;

use anyhow::{bail, Context as _, Result};
use ferl_config::SftConfig;
use ferl_data::{epoch_order, global_batch, rank_shard, steps_per_epoch, SftDataset};
use ferl_plugin_bridge::plugin_dataset;
use ferl_plugin_host::PluginHost;
use ferl_runtime::{Actor, Context, Handler};

use crate::messages::*;
use crate::rank::model_dir;

/// The order of global batches over epochs (pure; the actor and the launcher path share it).
#[derive(Clone, Debug)]
pub struct DataPlan {
    len: usize,
    batch: usize,
    seed: u64,
    shuffle: bool,
    position: DataPosition,
    order: Option<(u64, Vec<usize>)>,
}

impl DataPlan {
    /// A plan over `len` samples with the config's batch size, seed and shuffling, starting at epoch 0.
    pub fn new(cfg: &SftConfig, len: usize) -> Result<Self> {
        let batch = cfg.data.train_batch_size;
        if steps_per_epoch(len, batch) == 0 {
            bail!("data.train_batch_size={batch} is larger than the training set ({len} samples): no whole batch");
        }
        Ok(Self {
            len,
            batch,
            seed: cfg.trainer.seed,
            shuffle: cfg.data.shuffle,
            position: DataPosition::default(),
            order: None,
        })
    }

    /// Steps per epoch.
    pub fn steps_per_epoch(&self) -> u64 {
        steps_per_epoch(self.len, self.batch) as u64
    }

    /// The position of the next batch.
    pub fn position(&self) -> DataPosition {
        self.position
    }

    /// Moves to `position` (resume); a step past the epoch's end moves to the next epoch.
    pub fn set_position(&mut self, position: DataPosition) {
        self.position = position;
        if self.position.step_in_epoch >= self.steps_per_epoch() {
            self.position = DataPosition {
                epoch: position.epoch + 1,
                step_in_epoch: 0,
            };
        }
    }

    /// The sample indices of the next global batch and its position; advances.
    pub fn next_batch(&mut self) -> (DataPosition, Vec<usize>) {
        let at = self.position;
        if self.order.as_ref().map(|(e, _)| *e) != Some(at.epoch) {
            self.order = Some((
                at.epoch,
                epoch_order(self.len, self.seed, at.epoch, self.shuffle),
            ));
        }
        let order = &self.order.as_ref().expect("order of the current epoch").1;
        let indices = global_batch(order, self.batch, at.step_in_epoch as usize).to_vec();
        self.set_position(DataPosition {
            epoch: at.epoch,
            step_in_epoch: at.step_in_epoch + 1,
        });
        (at, indices)
    }
}

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

/// Loads the training set (and the validation set when `trainer.test_freq > 0` and files are given); with
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
    let dir = model_dir(cfg);
    let with_val = cfg.trainer.test_freq > 0 && !cfg.data.val_files.as_slice().is_empty();
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
    /// Data-parallel ranks to split each batch over.
    pub world_size: u64,
}

struct LoaderState {
    plan: DataPlan,
}

/// The data-loader actor.
pub struct DataLoader {
    train: SftDataset,
    val: Option<SftDataset>,
    world: usize,
    state: Mutex<LoaderState>,
}

impl Actor for DataLoader {
    type Args = DataLoaderArgs;
    const NAME: &'static str = "ferl.actors.DataLoader";
    async fn start(args: DataLoaderArgs, _: &Context) -> Result<Self> {
        let cfg = SftConfig::from_yaml(&args.config_yaml, &[])
            .context("data loader: reading the config")?;
        let (train, val, plan) = tokio::task::spawn_blocking(move || {
            let (train, val) = load_datasets(&cfg)?;
            let plan = DataPlan::new(&cfg, train.len())?;
            anyhow::Ok((train, val, plan))
        })
        .await
        .context("data loader: tokenizing task")??;
        let world = (args.world_size as usize).max(1);
        Ok(Self {
            train,
            val,
            world,
            state: Mutex::new(LoaderState { plan }),
        })
    }
}

impl DataLoader {
    fn plan(&self) -> Result<std::sync::MutexGuard<'_, LoaderState>> {
        self.state
            .lock()
            .map_err(|_| anyhow::anyhow!("data loader state lock poisoned"))
    }
}

impl Handler<GetDatasetInfo> for DataLoader {
    async fn handle(&self, _: GetDatasetInfo, _: &Context) -> Result<DatasetInfo> {
        Ok(DatasetInfo {
            train_len: self.train.len() as u64,
            val_len: self.val.as_ref().map_or(0, |v| v.len() as u64),
            steps_per_epoch: self.plan()?.plan.steps_per_epoch(),
        })
    }
}

impl Handler<NextBatch> for DataLoader {
    async fn handle(&self, _: NextBatch, _: &Context) -> Result<GlobalBatch> {
        let (position, indices) = self.plan()?.plan.next_batch();
        let shards = split_samples(&self.train, &indices, self.world);
        let global_targets = shards.iter().flatten().map(Sample::num_targets).sum();
        let tokens = shards
            .iter()
            .flatten()
            .map(|s| s.input_ids.len() as i64)
            .sum();
        Ok(GlobalBatch {
            position,
            shards,
            global_targets,
            tokens,
        })
    }
}

impl Handler<SetPosition> for DataLoader {
    async fn handle(&self, m: SetPosition, _: &Context) -> Result<()> {
        self.plan()?.plan.set_position(m.0);
        Ok(())
    }
}

impl Handler<GetPosition> for DataLoader {
    async fn handle(&self, _: GetPosition, _: &Context) -> Result<DataPosition> {
        Ok(self.plan()?.plan.position())
    }
}

impl Handler<ValShards> for DataLoader {
    async fn handle(&self, _: ValShards, _: &Context) -> Result<Vec<Vec<Sample>>> {
        let Some(val) = &self.val else {
            return Ok(vec![Vec::new(); self.world]);
        };
        let all: Vec<usize> = (0..val.len()).collect();
        Ok(split_samples(val, &all, self.world))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(batch: usize, shuffle: bool) -> SftConfig {
        let mut c = SftConfig::resolved_default();
        c.data.train_batch_size = batch;
        c.data.shuffle = shuffle;
        c
    }

    #[test]
    fn invariant_1_batches_do_not_depend_on_world_size() {
        let mut a = DataPlan::new(&cfg(4, true), 10).unwrap();
        let batches: Vec<_> = (0..5).map(|_| a.next_batch().1).collect();
        // Epoch 0 has 2 whole batches (10 / 4); the third call starts epoch 1 with a different order.
        assert_eq!(batches[0].len(), 4);
        assert_ne!(batches[0], batches[2]);
        let mut b = DataPlan::new(&cfg(4, true), 10).unwrap();
        for expected in &batches {
            assert_eq!(&b.next_batch().1, expected);
        }
    }

    #[test]
    fn invariant_2_epoch_boundary_resumes_at_next_epoch() {
        let mut plan = DataPlan::new(&cfg(5, false), 10).unwrap();
        plan.set_position(DataPosition {
            epoch: 0,
            step_in_epoch: 2,
        });
        assert_eq!(
            plan.position(),
            DataPosition {
                epoch: 1,
                step_in_epoch: 0
            }
        );
        let (at, idx) = plan.next_batch();
        assert_eq!(
            at,
            DataPosition {
                epoch: 1,
                step_in_epoch: 0
            }
        );
        assert_eq!(idx, vec![0, 1, 2, 3, 4]);
        assert!(DataPlan::new(&cfg(11, false), 10)
            .unwrap_err()
            .to_string()
            .contains("train_batch_size=11"));
    }
}
