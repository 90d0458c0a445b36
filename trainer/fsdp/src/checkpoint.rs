//! Sharded checkpoints that outlive the cluster shape.
//!
//! # Format (one `global_step_N/` folder)
//! - `model_world_size_{W}_rank_{r}.safetensors`: for every unit, rank `r`'s slice `[r * shard, (r + 1) * shard)` of the
//!   unit's padded flat fp32 master (tensor name = unit name, e.g. `layers.3`).
//! - `optim_world_size_{W}_rank_{r}.safetensors`: the same slices of AdamW's `{unit}.exp_avg` and `{unit}.exp_avg_sq`
//!   (trainable units only: a frozen LoRA base has no optimizer state).
//! - `fsdp_meta.json` ([`CheckpointMeta`]): world size, global step, AdamW step count, and the unit layout (member
//!   tensors, shapes, offsets, unpadded sizes). Rank 0 writes it after every rank has written its files, so its
//!   presence marks a complete checkpoint.
//!
//! The files are the same whatever the strategy (a NO_SHARD rank writes its slice of its replica), and loading works
//! at any world size and strategy: each rank reads only the bytes of the old slices overlapping its new range (the
//! files' headers, then those byte ranges) and reslices them. It goes tensor by tensor through the metadata's units
//! (their padding, `row_len`, included), so a checkpoint whose units group the tensors otherwise — an older build's —
//! loads as well.
//!
//! Under HSDP (shard groups of `S` ranks, see [`crate::groups`]) only the first shard group (replica 0) writes: the
//! files are those of an `S`-rank run (`world_size` = `S`, `replica_groups` = `world / S` in the metadata), since
//! every shard group holds the same whole model. They load at any world size and any `S` like any other.

use crate::groups::ShardGroups;
use crate::store::{local_range, ShardedParams};
use crate::units::{FlatEntry, FlatUnit, UnitPlan};
use crate::FsdpOptions;
use anyhow::{bail, Context, Result};
use ferl_trainer::model::config::ModelConfig;
use ferl_trainer::model::layout::ModelLayout;
use ferl_trainer::model::lora::{
    merge, write_adapter, LoraSpec, ADAPTER_CONFIG, CHECKPOINT_ADAPTER_DIR,
};
use ferl_trainer::model::weights::{save_hf_folder, write_safetensors, SafetensorsFile};
use ferl_trainer::optim::{AdamW, AdamWConfig};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use tch::{Device, Kind, Tensor};

/// Name of the metadata file of a sharded checkpoint.
pub const META_FILE: &str = "fsdp_meta.json";
const FORMAT: &str = "ferl-fsdp/1";

/// What a sharded checkpoint holds and how it was cut.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct CheckpointMeta {
    /// Format tag (`ferl-fsdp/1`).
    pub format: String,
    /// Number of ranks that wrote the checkpoint (under HSDP, the shard group's size: the files are cut for it).
    pub world_size: usize,
    /// Shard groups of the run that saved it (HSDP; 1 otherwise): each held the whole model and only the first
    /// wrote it. Informational: loading needs only `world_size`.
    #[serde(default = "one")]
    pub replica_groups: usize,
    /// Training steps completed when it was taken.
    pub global_step: i64,
    /// AdamW's step count (bias correction).
    pub optimizer_step: i64,
    /// The flat units, in order.
    pub units: Vec<FlatUnit>,
    /// The model's `config.json` as read (lets [`export_sharded`] write a Hugging Face folder without the source).
    #[serde(default)]
    pub model_config: Option<serde_json::Value>,
}

fn one() -> usize {
    1
}

/// The model file of rank `r` at world size `w`.
pub fn model_file(dir: &Path, w: usize, r: usize) -> PathBuf {
    dir.join(format!("model_world_size_{w}_rank_{r}.safetensors"))
}

/// The optimizer file of rank `r` at world size `w`.
pub fn optim_file(dir: &Path, w: usize, r: usize) -> PathBuf {
    dir.join(format!("optim_world_size_{w}_rank_{r}.safetensors"))
}

/// One rank's part of a checkpoint, copied out of the live state so it can be written while training continues.
pub struct ShardSnapshot {
    /// Metadata (identical on every rank).
    pub meta: CheckpointMeta,
    /// The rank that took it (within its shard group under HSDP).
    pub rank: usize,
    /// Its replica (shard group) index under HSDP, else 0: only replica 0 writes files.
    pub replica: usize,
    /// Unit name → this rank's slice of the master.
    pub model: Vec<(String, Tensor)>,
    /// `{unit}.exp_avg` / `{unit}.exp_avg_sq` → this rank's slices of the AdamW moments.
    pub optim: Vec<(String, Tensor)>,
    /// Whether the tensors are views of the live ones (CPU masters); from a GPU they are host copies already.
    views: bool,
}

impl ShardSnapshot {
    /// Copies this rank's slices of the masters and of `optimizer`'s moments (CPU copies) after `global_step` steps.
    pub fn take(store: &ShardedParams, optimizer: &AdamW, global_step: i64) -> Result<Self> {
        Ok(Self::view(store, optimizer, global_step)?.into_owned())
    }

    /// The snapshot's tensors as copies of their own, so that training may go on while they are written.
    pub fn into_owned(mut self) -> Self {
        if !self.views {
            return self;
        }
        self.views = false;
        let own = |list: &mut Vec<(String, Tensor)>| {
            for (_, t) in list.iter_mut() {
                *t = t.copy();
            }
        };
        own(&mut self.model);
        own(&mut self.optim);
        self
    }

    /// Bytes the snapshot's tensors hold (what [`Self::into_owned`] copies).
    pub fn bytes(&self) -> u64 {
        let size = |t: &Tensor| (t.numel() * t.kind().elt_size_in_bytes()) as u64;
        self.model
            .iter()
            .chain(&self.optim)
            .map(|(_, t)| size(t))
            .sum()
    }

    /// [`Self::take`] without copying: views of the store's and the optimizer's tensors, to be written before they
    /// change (the next optimizer step).
    pub fn view(store: &ShardedParams, optimizer: &AdamW, global_step: i64) -> Result<Self> {
        let (rank, world) = store.rank_and_world();
        let (replica, replicas) = store.replica_rank_and_count();
        let plan = store.plan();
        if optimizer.exp_avg.len() != plan.trainable_units() {
            bail!(
                "checkpoint: the optimizer has {} state tensors but the store has {} trainable units",
                optimizer.exp_avg.len(),
                plan.trainable_units()
            );
        }
        let (mut model, mut optim) = (Vec::new(), Vec::new());
        for (u, unit) in plan.units.iter().enumerate() {
            let shard = unit.shard_len(world);
            let (start, _) = store.local_range(u);
            let at = shard * rank as i64 - start;
            let cut = |t: &Tensor| t.narrow(0, at, shard).to_device(Device::Cpu);
            model.push((unit.name.clone(), cut(&store.local_masters()[u])));
            if unit.frozen {
                continue; // no optimizer state (units.rs invariant 4)
            }
            optim.push((format!("{}.exp_avg", unit.name), cut(&optimizer.exp_avg[u])));
            optim.push((
                format!("{}.exp_avg_sq", unit.name),
                cut(&optimizer.exp_avg_sq[u]),
            ));
        }
        Ok(Self {
            meta: CheckpointMeta {
                format: FORMAT.into(),
                world_size: world,
                replica_groups: replicas,
                global_step,
                optimizer_step: optimizer.step,
                units: plan.units.clone(),
                model_config: None,
            },
            rank,
            replica,
            views: store
                .local_masters()
                .iter()
                .chain(&optimizer.exp_avg)
                .any(|t| t.device() == Device::Cpu),
            model,
            optim,
        })
    }

    /// Records the model's config in the metadata (so the checkpoint exports on its own).
    pub fn with_model_config(mut self, cfg: &ModelConfig) -> Self {
        self.meta.model_config = Some(cfg.raw.clone());
        self
    }

    /// The files [`Self::write`] writes into `dir`: this rank's two, none for a replica other than the first.
    pub fn files(&self, dir: &Path) -> Vec<PathBuf> {
        let w = self.meta.world_size;
        match self.replica {
            0 => vec![model_file(dir, w, self.rank), optim_file(dir, w, self.rank)],
            _ => Vec::new(),
        }
    }

    /// Whether this snapshot's rank writes `fsdp_meta.json` (rank 0 of the first replica).
    pub fn writes_meta(&self) -> bool {
        self.rank == 0 && self.replica == 0
    }

    /// Writes this rank's two files into `dir` (created if needed; nothing for a replica other than the first).
    /// The rank of [`Self::writes_meta`] should call [`ShardSnapshot::write_meta`] once every rank's `write` has
    /// returned.
    pub fn write(&self, dir: &Path) -> Result<()> {
        if self.replica != 0 {
            return Ok(());
        }
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let w = self.meta.world_size;
        write_safetensors(&model_file(dir, w, self.rank), &self.model)?;
        write_safetensors(&optim_file(dir, w, self.rank), &self.optim)?;
        Ok(())
    }

    /// Writes `fsdp_meta.json`, marking the checkpoint complete.
    pub fn write_meta(&self, dir: &Path) -> Result<()> {
        let path = dir.join(META_FILE);
        let tmp = dir.join(format!("{META_FILE}.tmp"));
        std::fs::write(&tmp, serde_json::to_string_pretty(&self.meta)?)
            .with_context(|| format!("writing {}", tmp.display()))?;
        std::fs::rename(&tmp, &path).with_context(|| format!("renaming to {}", path.display()))
    }
}

/// Saves a sharded checkpoint of the model with `cfg` from every rank (collective: all ranks call it): each writes its
/// files, then rank 0 writes the metadata once all have finished.
pub fn save_sharded(
    store: &mut ShardedParams,
    optimizer: &AdamW,
    cfg: &ModelConfig,
    global_step: i64,
    dir: &Path,
) -> Result<()> {
    // Written before anything changes: the shards need no copy.
    let snap = ShardSnapshot::view(store, optimizer, global_step)?.with_model_config(cfg);
    let written = snap.write(dir);
    let ok = store.all_reduce_sum(&[if written.is_ok() { 0.0 } else { 1.0 }])?;
    written?;
    if ok[0] != 0.0 {
        bail!(
            "checkpoint {}: {} rank(s) failed to write their shards",
            dir.display(),
            ok[0]
        );
    }
    if snap.writes_meta() {
        snap.write_meta(dir)?;
    }
    Ok(())
}

/// Reads `dir/fsdp_meta.json`.
pub fn read_meta(dir: &Path) -> Result<CheckpointMeta> {
    let path = dir.join(META_FILE);
    let text = std::fs::read_to_string(&path).with_context(|| {
        format!(
            "reading {} (an incomplete or non-ferl checkpoint?)",
            path.display()
        )
    })?;
    let meta: CheckpointMeta =
        serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    if meta.format != FORMAT {
        bail!(
            "{}: format `{}`, expected `{FORMAT}`",
            path.display(),
            meta.format
        );
    }
    Ok(meta)
}

/// Reads ranges of units out of one kind of shard file: each file's header once, then only the bytes asked for.
struct ShardReader<'a> {
    dir: &'a Path,
    meta: &'a CheckpointMeta,
    file: fn(&Path, usize, usize) -> PathBuf,
    open: HashMap<usize, SafetensorsFile>,
}

impl ShardReader<'_> {
    fn new<'a>(
        dir: &'a Path,
        meta: &'a CheckpointMeta,
        file: fn(&Path, usize, usize) -> PathBuf,
    ) -> ShardReader<'a> {
        ShardReader {
            dir,
            meta,
            file,
            open: HashMap::new(),
        }
    }

    /// Tensor bytes read so far from every file opened.
    fn bytes_read(&self) -> u64 {
        self.open.values().map(SafetensorsFile::bytes_read).sum()
    }

    /// Elements `[lo, hi)` of unit `u`'s unpadded flat buffer, for tensor `name` of the shard files (fp32, CPU).
    fn range(&mut self, u: usize, name: &str, lo: i64, hi: i64) -> Result<Tensor> {
        let out = Tensor::zeros([hi - lo], (Kind::Float, Device::Cpu));
        let shard = self.meta.units[u].shard_len(self.meta.world_size);
        let mut pos = lo;
        while pos < hi {
            let k = (pos / shard) as usize;
            let end = hi.min((k as i64 + 1) * shard);
            let path = (self.file)(self.dir, self.meta.world_size, k);
            let file = match self.open.entry(k) {
                std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
                std::collections::hash_map::Entry::Vacant(e) => {
                    e.insert(SafetensorsFile::open(&path)?)
                }
            };
            match file.shape(name) {
                None => bail!("{}: tensor `{name}` missing", path.display()),
                Some(s) if s != [shard] => bail!(
                    "{}: tensor `{name}` has shape {s:?}, expected [{shard}]",
                    path.display()
                ),
                Some(_) => {}
            }
            let at = k as i64 * shard;
            let src = file.read_range(name, pos - at, end - at)?;
            out.narrow(0, pos - lo, end - pos).copy_(&src);
            pos = end;
        }
        Ok(out)
    }
}

/// Where each of the model's tensors lies in the checkpoint: per unit of `plan`, per entry, its `(unit, entry)` in
/// `meta.units`. The checkpoint may group and pad the tensors otherwise (an older build's units); it must hold exactly
/// the model's tensors, with the same shapes, the same ones training.
fn locate_tensors(
    dir: &Path,
    meta: &CheckpointMeta,
    plan: &UnitPlan,
) -> Result<Vec<Vec<(usize, usize)>>> {
    let mut saved: HashMap<&str, (usize, usize)> = HashMap::new();
    for (u, unit) in meta.units.iter().enumerate() {
        for (i, e) in unit.entries.iter().enumerate() {
            saved.insert(e.name.as_str(), (u, i));
        }
    }
    let locate = |unit: &FlatUnit, e: &FlatEntry| -> Result<(usize, usize)> {
        let &(u, i) = saved.get(e.name.as_str()).with_context(|| {
            format!(
                "{}: the checkpoint has no tensor `{}`",
                dir.display(),
                e.name
            )
        })?;
        let old = &meta.units[u];
        if old.entries[i].shape != e.shape {
            bail!(
                "{}: tensor `{}` has shape {:?} in the checkpoint, {:?} in the model",
                dir.display(),
                e.name,
                old.entries[i].shape,
                e.shape
            );
        }
        let role = |frozen: bool| if frozen { "frozen" } else { "trained" };
        if old.frozen != unit.frozen {
            bail!(
                "{}: tensor `{}` is {} in the checkpoint, {} in the model",
                dir.display(),
                e.name,
                role(old.frozen),
                role(unit.frozen)
            );
        }
        Ok((u, i))
    };
    let located: Vec<Vec<(usize, usize)>> = plan
        .units
        .iter()
        .map(|unit| unit.entries.iter().map(|e| locate(unit, e)).collect())
        .collect::<Result<_>>()?;
    let model: std::collections::HashSet<&str> = plan
        .units
        .iter()
        .flat_map(|u| u.entries.iter().map(|e| e.name.as_str()))
        .collect();
    if let Some(extra) = saved.keys().find(|n| !model.contains(*n)) {
        bail!(
            "{}: the checkpoint's tensor `{extra}` is not in the model (LoRA on one side only?)",
            dir.display()
        );
    }
    Ok(located)
}

/// This rank's local buffer of every unit of `plan` (`ranges`, from [`local_range`]) for the shard files' tensors
/// `{unit}{suffix}`, each tensor's elements read where `located` says the checkpoint holds them, padding zero; the
/// optimizer's moments (`suffix` `.exp_avg…`) only for the units that train.
fn read_local(
    reader: &mut ShardReader,
    plan: &UnitPlan,
    located: &[Vec<(usize, usize)>],
    ranges: &[(i64, i64)],
    suffix: &str,
) -> Result<Vec<Tensor>> {
    let meta = reader.meta;
    let mut out = Vec::new();
    for (u, unit) in plan.units.iter().enumerate() {
        if unit.frozen && suffix.starts_with(".exp_avg") {
            continue; // frozen units have no optimizer state
        }
        let (start, len) = ranges[u];
        let local = Tensor::zeros([len], (Kind::Float, Device::Cpu));
        for (e, &(old_u, old_i)) in unit.entries.iter().zip(&located[u]) {
            let (lo, hi) = (start.max(e.offset), (start + len).min(e.offset + e.numel));
            if hi <= lo {
                continue;
            }
            let old = &meta.units[old_u];
            let shift = old.entries[old_i].offset - e.offset;
            let name = format!("{}{suffix}", old.name);
            let part = reader.range(old_u, &name, lo + shift, hi + shift)?;
            local.narrow(0, lo - start, hi - lo).copy_(&part);
        }
        out.push(local);
    }
    Ok(out)
}

/// A store and optimizer restored from a sharded checkpoint.
pub struct LoadedShards {
    /// The restored parameter store at the new world size.
    pub store: ShardedParams,
    /// AdamW with restored moments and step count.
    pub optimizer: AdamW,
    /// The checkpoint's metadata (`global_step` = steps completed).
    pub meta: CheckpointMeta,
    /// Tensor bytes this rank read from the shard files: only the elements of its new range (headers aside).
    pub bytes_read: u64,
}

/// Loads the checkpoint in `dir` into a store over `comm` (any world size, any strategy; a communicator, or HSDP's
/// [`ShardGroups`], each shard group loading the whole model): each rank reads only the bytes of its new range from
/// the old slices overlapping it.
pub fn load_sharded(
    dir: &Path,
    layout: ModelLayout,
    comm: impl Into<ShardGroups>,
    opts: FsdpOptions,
    adam: AdamWConfig,
) -> Result<LoadedShards> {
    let meta = read_meta(dir)?;
    let plan = UnitPlan::new(&layout);
    let located = locate_tensors(dir, &meta, &plan)?;
    let groups: ShardGroups = comm.into();
    let (rank, world) = groups.shard_rank_and_size();
    let ranges: Vec<(i64, i64)> = plan
        .units
        .iter()
        .map(|u| local_range(opts.strategy, u.shard_len(world), rank, world))
        .collect();
    let mut bytes_read = 0;
    let mut read = |file: fn(&Path, usize, usize) -> PathBuf, suffix: &str| {
        let mut reader = ShardReader::new(dir, &meta, file);
        let out = read_local(&mut reader, &plan, &located, &ranges, suffix);
        bytes_read += reader.bytes_read();
        out
    };
    let masters = read(model_file, "")?;
    let exp_avg = read(optim_file, ".exp_avg")?;
    let exp_avg_sq = read(optim_file, ".exp_avg_sq")?;
    let store = ShardedParams::from_local_masters(layout, plan, masters, groups, opts)?;
    let device = store.local_masters()[0].device();
    let mut optimizer = AdamW::new(adam, store.trainable_masters());
    optimizer.exp_avg = exp_avg.into_iter().map(|t| t.to_device(device)).collect();
    optimizer.exp_avg_sq = exp_avg_sq
        .into_iter()
        .map(|t| t.to_device(device))
        .collect();
    optimizer.step = meta.optimizer_step;
    Ok(LoadedShards {
        store,
        optimizer,
        meta,
        bytes_read,
    })
}

/// The full, unsharded fp32 tensors of a sharded checkpoint, in the model layout's order, with their names.
pub fn assemble_full(dir: &Path) -> Result<(CheckpointMeta, Vec<(String, Tensor)>)> {
    let meta = read_meta(dir)?;
    let mut reader = ShardReader::new(dir, &meta, model_file);
    let mut named: Vec<(usize, String, Tensor)> = Vec::new();
    for (u, unit) in meta.units.iter().enumerate() {
        let flat = reader.range(u, &unit.name, 0, unit.numel)?;
        for (i, e) in unit.entries.iter().enumerate() {
            named.push((e.layout_index, e.name.clone(), unit.view(&flat, i).copy()));
        }
    }
    named.sort_by_key(|(i, _, _)| *i);
    let tensors = named.into_iter().map(|(_, n, t)| (n, t)).collect();
    Ok((meta, tensors))
}

/// What `ferl export` writes from a LoRA checkpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum LoraExport {
    /// The merged model (`W + (α/r)·B·A`) as a Hugging Face folder; a plain model's folder otherwise.
    #[default]
    Merge,
    /// Only the adapter, in PEFT's format (`adapter_config.json`, `adapter_model.safetensors`).
    AdapterOnly,
}

/// The LoRA of a checkpoint, from the PEFT config its `lora_adapter/` folder holds, applied to `layout`.
fn checkpoint_lora(
    dir: &Path,
    cfg: &ModelConfig,
    layout: &mut ModelLayout,
) -> Result<Option<(LoraSpec, String)>> {
    let file = dir.join(CHECKPOINT_ADAPTER_DIR).join(ADAPTER_CONFIG);
    if !file.is_file() {
        return Ok(None);
    }
    let spec = LoraSpec::from_adapter_config(&file)?;
    layout.add_lora(&spec, &spec.projections(cfg.num_layers)?);
    let raw: serde_json::Value = serde_json::from_slice(&std::fs::read(&file)?)?;
    let base = raw["base_model_name_or_path"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    Ok(Some((spec, base)))
}

/// Writes the Hugging Face folder `out` (config.json, model.safetensors in `kind`, side files from `side_from`) from
/// the sharded checkpoint `dir` of a model with `cfg`; for a LoRA checkpoint, the merged model or (`AdapterOnly`)
/// the PEFT adapter.
pub fn export_hf(
    dir: &Path,
    cfg: &ModelConfig,
    out: &Path,
    kind: Kind,
    side_from: &[&Path],
    lora: LoraExport,
) -> Result<()> {
    let mut layout = ModelLayout::new(cfg);
    let adapter = checkpoint_lora(dir, cfg, &mut layout)?;
    let (_, named) = assemble_full(dir)?;
    if named.len() != layout.tensors.len() {
        bail!(
            "{}: the checkpoint has {} tensors, the model config implies {}",
            dir.display(),
            named.len(),
            layout.tensors.len()
        );
    }
    for ((name, shape), (n, t)) in layout.tensors.iter().zip(&named) {
        if name != n || t.size() != *shape {
            bail!(
                "{}: tensor `{n}` {:?} where the config implies `{name}` {shape:?}",
                dir.display(),
                t.size()
            );
        }
    }
    let params: Vec<Tensor> = named.into_iter().map(|(_, t)| t).collect();
    match (adapter, lora) {
        (Some((spec, base)), LoraExport::AdapterOnly) => {
            write_adapter(out, &spec, &layout, &params[layout.base_len()..], &base)
        }
        (None, LoraExport::AdapterOnly) => bail!(
            "{}: --adapter-only needs a LoRA checkpoint (no {CHECKPOINT_ADAPTER_DIR}/{ADAPTER_CONFIG} there)",
            dir.display()
        ),
        (Some(_), LoraExport::Merge) => {
            let merged = merge(&layout, &params);
            save_hf_folder(out, cfg, &ModelLayout::new(cfg), &merged, kind, side_from)
        }
        (None, LoraExport::Merge) => save_hf_folder(out, cfg, &layout, &params, kind, side_from),
    }
}

/// `ferl export` for a sharded checkpoint: writes the Hugging Face folder `out` in `kind` using the model config the
/// checkpoint recorded (pass `dir.join("huggingface")` as `out` to give the checkpoint verl's `huggingface/` folder,
/// which `ferl_trainer::checkpoint::export` then reads).
pub fn export_sharded(
    dir: &Path,
    out: &Path,
    kind: Kind,
    side_from: &[&Path],
    lora: LoraExport,
) -> Result<()> {
    let meta = read_meta(dir)?;
    let raw = meta.model_config.with_context(|| {
        format!(
            "{}: the checkpoint recorded no model config; use export_hf with the model's config",
            dir.display()
        )
    })?;
    let cfg = ModelConfig::from_value(raw, &dir.join(META_FILE))?;
    export_hf(dir, &cfg, out, kind, side_from, lora)
}
