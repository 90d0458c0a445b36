//! The one config gate: every launch path (one process, `--nproc-per-node`, a cluster, torchrun/SLURM ranks) calls
//! [`check`] with the whole config before anything is loaded or spawned. A key is honoured the same way on every
//! path or refused on every path with the same message; nothing is accepted and ignored.
//!
//! Keys ferl has no use for are accepted only where that is honest and documented on the key: `data.use_shm`,
//! `model.use_shm` (load paths), `data.balance_dp_token` (ferl's loss is always the exact global token-mean),
//! `data.num_workers` (data is tokenized before training), `model.strategy` (`fsdp` and `fsdp2` are the same engine),
//! `model.fsdp_config.forward_prefetch` (the next layer's gather always overlaps compute).

use super::RankLayout;
use crate::model::lora::{LoraSpec, ADAPTER_CONFIG};
use anyhow::{bail, Context, Result};
use ferl_config::{Dtype, ModelConfig as ModelSection, SftConfig, Supported};
use std::path::PathBuf;
use tch::{Device, Kind};

/// The launch a config is checked against.
#[derive(Clone, Debug)]
pub struct LaunchShape {
    /// Data-parallel ranks of the run.
    pub world_size: usize,
    /// Whether this process decides the device itself (one process, an embedded cluster, a launcher rank); false
    /// for a remote cluster, whose ranks check their own device.
    pub local_device: bool,
    /// Logger kinds `trainer.logger` may name (built in and loaded plugins).
    pub loggers: Vec<String>,
    /// Whether ferl starts the ranks itself (one process, `--nproc-per-node`, a cluster) and so can restart them
    /// (`trainer.max_restarts`); false under torchrun/SLURM, whose launcher restarts ranks.
    pub restarts_ranks: bool,
}

/// The parts `trainer.checkpoint.save_contents`/`load_contents` may list; `model`, `optimizer` and `extra` are
/// always needed to resume, `hf_model` adds a `huggingface/` folder.
const CONTENTS: [&str; 4] = ["model", "optimizer", "extra", "hf_model"];

/// The keys every executor honours with any value (see [`supported_keys`] for those restricted to some values).
const SUPPORTED_KEYS: &[&str] = &[
    "data.train_batch_size",
    "data.micro_batch_size",
    "data.micro_batch_size_per_gpu",
    "data.use_dynamic_bsz",
    "data.max_token_len_per_gpu",
    "data.train_files",
    "data.val_files",
    "data.train_max_samples",
    "data.val_max_samples",
    "data.prompt_key",
    "data.response_key",
    "data.prompt_dict_keys",
    "data.response_dict_keys",
    "data.multiturn.*",
    "data.max_length",
    "data.truncation",
    "data.balance_dp_token",
    "data.chat_template",
    "data.use_shm",
    "data.num_workers",
    "data.apply_chat_template_kwargs",
    "data.apply_chat_template_kwargs.*",
    "data.shuffle",
    "data.plugin",
    "data.plugin_options",
    "data.plugin_options.*",
    "data.custom_cls.*",
    "model.partial_pretrain",
    "model.use_shm",
    "model.enable_gradient_checkpointing",
    "model.lora_rank",
    "model.lora_alpha",
    "model.target_modules",
    "model.exclude_modules",
    "model.lora_adapter_path",
    "model.strategy",
    "model.fsdp_config.model_dtype",
    "model.fsdp_config.mixed_precision",
    "model.fsdp_config.mixed_precision.*",
    "model.fsdp_config.reshard_after_forward",
    "model.fsdp_config.forward_prefetch",
    "model.fsdp_config.cpu_offload",
    "model.fsdp_config.offload_params",
    "model.fsdp_config.sharding_strategy",
    "model.fsdp_config.fsdp_size",
    "optim.lr",
    "optim.lr_warmup_steps_ratio",
    "optim.lr_warmup_steps",
    "optim.weight_decay",
    "optim.betas",
    "optim.clip_grad",
    "optim.min_lr_ratio",
    "optim.num_cycles",
    "optim.lr_scheduler",
    "trainer.default_local_dir",
    "trainer.project_name",
    "trainer.experiment_name",
    "trainer.total_epochs",
    "trainer.total_training_steps",
    "trainer.seed",
    "trainer.save_freq",
    "trainer.test_freq",
    "trainer.max_ckpt_to_keep",
    "trainer.resume_mode",
    "trainer.resume_from_path",
    "trainer.nnodes",
    "trainer.n_gpus_per_node",
    "trainer.max_restarts",
    "trainer.elastic",
    "trainer.restart_wait_s",
    "use_remove_padding",
    "ulysses_sequence_parallel_size",
];

/// The keys every executor honours (values restricted where only some are).
pub fn supported_keys(loggers: &[String]) -> Supported {
    let mut names: Vec<&str> = loggers.iter().map(String::as_str).collect();
    names.sort_unstable();
    names.dedup();
    Supported::new()
        .keys(SUPPORTED_KEYS)
        .values("optim.optimizer", &["AdamW"])
        .values("optim.optimizer_impl", &["torch.optim"])
        .values("model.use_liger", &["false", "true"])
        .values("model.fsdp_config.wrap_policy.min_num_params", &["0"])
        .values("trainer.device", &["cpu", "cuda"])
        .values("trainer.logger", &names)
        .values("trainer.checkpoint.save_contents", &CONTENTS)
        .values("trainer.checkpoint.load_contents", &CONTENTS)
}

/// Checks `cfg` for `launch`: supported keys and values, precision, device, batch split, checkpoint contents and
/// the launch shape. One message per path-independent problem.
pub fn check(cfg: &SftConfig, launch: &LaunchShape) -> Result<()> {
    cfg.validate_supported(&supported_keys(&launch.loggers))?;
    compute_kind(cfg)?;
    check_contents(cfg)?;
    check_batch_split(cfg, launch.world_size)?;
    check_shape(cfg, launch.world_size)?;
    check_restarts(cfg, launch.restarts_ranks)?;
    if launch.local_device {
        device_of(cfg, 0)?;
    }
    Ok(())
}

/// The dtype stages compute in: `mixed_precision.param_dtype` if set, else `model_dtype`. fp16 is refused on
/// every path (it needs dynamic loss scaling, which ferl does not do).
pub fn compute_kind(cfg: &SftConfig) -> Result<Kind> {
    let fc = &cfg.model.fsdp_config;
    let d = fc
        .mixed_precision
        .as_ref()
        .map(|m| m.param_dtype)
        .unwrap_or(fc.model_dtype);
    match d {
        Dtype::Fp32 => Ok(Kind::Float),
        Dtype::Bf16 => Ok(Kind::BFloat16),
        Dtype::Fp16 => bail!(
            "model.fsdp_config.model_dtype / mixed_precision.param_dtype: fp16 is not supported (it needs loss \
             scaling; use bf16 or fp32)"
        ),
    }
}

/// Whether torch sees a CUDA device. Loads libtorch_cuda first: the linker's `--as-needed` drops it from our
/// binaries (nothing references it by symbol), and without it torch reports no CUDA at all.
pub fn cuda_is_available() -> bool {
    if let Err(e) = ferl_collective::load_torch_cuda() {
        tracing::debug!("{e:#}");
        return false;
    }
    tch::Cuda::is_available()
}

/// The device `trainer.device` names for the rank using local device `local_index`. `cuda` without a visible GPU
/// is an error on every path (never a silent CPU fallback).
pub fn device_of(cfg: &SftConfig, local_index: usize) -> Result<Device> {
    match cfg.trainer.device.as_str() {
        "cpu" => Ok(Device::Cpu),
        "cuda" if cuda_is_available() => Ok(Device::Cuda(local_index)),
        "cuda" => Err(no_cuda_device()),
        other => bail!("trainer.device: `{other}` is not supported (cpu, cuda)"),
    }
}

/// The refusal of `trainer.device=cuda` where no GPU is visible (the same words on every path).
pub fn no_cuda_device() -> anyhow::Error {
    anyhow::anyhow!("trainer.device=cuda but no CUDA device is visible; set trainer.device=cpu")
}

fn check_contents(cfg: &SftConfig) -> Result<()> {
    let c = &cfg.trainer.checkpoint;
    for (key, list) in [
        ("save_contents", &c.save_contents),
        ("load_contents", &c.load_contents),
    ] {
        let missing: Vec<&str> = CONTENTS[..3]
            .iter()
            .copied()
            .filter(|p| !list.as_slice().iter().any(|x| x == p))
            .collect();
        if !missing.is_empty() {
            bail!(
                "trainer.checkpoint.{key} lacks {}: ferl checkpoints always hold model, optimizer and extra \
                 (a resume needs all three); only hf_model may be added",
                missing.join(", ")
            );
        }
    }
    Ok(())
}

/// Every rank must run the same number of micro-batches per step, so the global batch splits evenly over the ranks
/// (verl requires the same), and micro-batches are whole; a token budget holds at least one longest sample. The
/// rank layout (`RankLayout::new`) refuses a sequence-parallel or HSDP (`model.fsdp_config.fsdp_size`) group size
/// that does not divide the ranks.
fn check_batch_split(cfg: &SftConfig, world: usize) -> Result<()> {
    let (batch, micro) = (cfg.data.train_batch_size, cfg.data.micro_batch_size_per_gpu);
    let dp = RankLayout::new(cfg, world)?.dp_world();
    if !batch.is_multiple_of(dp) {
        let groups = match dp == world {
            true => format!("{world} ranks"),
            false => format!("{dp} data-parallel groups of ulysses_sequence_parallel_size ranks"),
        };
        bail!("data.train_batch_size={batch} does not split evenly over {groups} (make it a multiple of {dp})");
    }
    if micro == 0 {
        bail!("data.micro_batch_size_per_gpu must be at least 1");
    }
    let (budget, max_length) = (cfg.data.max_token_len_per_gpu, cfg.data.max_length);
    if cfg.data.use_dynamic_bsz && budget < max_length {
        bail!(
            "data.max_token_len_per_gpu={budget} is smaller than data.max_length={max_length}: with \
             data.use_dynamic_bsz=true one sample of up to max_length tokens must fit a micro-batch (raise the \
             budget to at least {max_length})"
        );
    }
    Ok(())
}

/// Whether `world` ranks keep the global batch: it splits evenly over them (an elastic restart's sizes).
pub fn batch_splits(cfg: &SftConfig, world: usize) -> bool {
    RankLayout::new(cfg, world)
        .is_ok_and(|l| cfg.data.train_batch_size.is_multiple_of(l.dp_world()))
}

/// `trainer.max_restarts` needs ranks ferl started; `trainer.elastic` needs restarts to act on.
fn check_restarts(cfg: &SftConfig, restarts_ranks: bool) -> Result<()> {
    let t = &cfg.trainer;
    if t.max_restarts > 0 && !restarts_ranks {
        bail!(
            "trainer.max_restarts={}: under torchrun/SLURM the launcher restarts ranks (torchrun --max-restarts, \
             srun --requeue) and trainer.resume_mode=auto resumes from the last checkpoint; ferl restarts ranks \
             itself with `ferl sft --nproc-per-node` or on a cluster",
            t.max_restarts
        );
    }
    if t.elastic && t.max_restarts == 0 {
        bail!("trainer.elastic=true acts on restarts: set trainer.max_restarts to at least 1");
    }
    Ok(())
}

/// verl sizes a run by `trainer.nnodes` × `trainer.n_gpus_per_node`; ferl takes the size from the launch, so when
/// either key is set it must agree with it.
fn check_shape(cfg: &SftConfig, world: usize) -> Result<()> {
    let set = cfg
        .changed_keys()
        .iter()
        .any(|(k, _)| k == "trainer.nnodes" || k == "trainer.n_gpus_per_node");
    let (nodes, per_node) = (cfg.trainer.nnodes, cfg.trainer.n_gpus_per_node);
    if set && nodes * per_node != world {
        bail!(
            "trainer.nnodes={nodes} × trainer.n_gpus_per_node={per_node} = {} ranks does not match the launch \
             (ferl takes the size from --nnodes × --nproc-per-node or the launcher's WORLD_SIZE; drop the keys \
             or make them agree)",
            nodes * per_node
        );
    }
    Ok(())
}

/// Whether `trainer.save_contents` asks for the `huggingface/` folder.
pub fn saves_hf_model(cfg: &SftConfig) -> bool {
    let list = &cfg.trainer.checkpoint.save_contents;
    list.as_slice().iter().any(|x| x == "hf_model")
}

/// The LoRA a run trains, if any: from `model.lora_rank` > 0 (with `lora_alpha`, `target_modules`,
/// `exclude_modules`), or from the PEFT folder `model.lora_adapter_path`, whose `adapter_config.json` decides rank,
/// alpha and modules; a `lora_rank`/`lora_alpha` that contradicts it is refused rather than ignored.
pub fn lora_of(cfg: &SftConfig) -> Result<Option<(LoraSpec, Option<PathBuf>)>> {
    let m = &cfg.model;
    let Some(path) = &m.lora_adapter_path else {
        if m.lora_rank == 0 {
            return Ok(None);
        }
        let spec = LoraSpec {
            rank: m.lora_rank as i64,
            alpha: m.lora_alpha,
            targets: m.target_modules.as_slice().to_vec(),
            exclude: m.exclude_modules.as_slice().to_vec(),
        };
        return Ok(Some((spec, None)));
    };
    let dir = ferl_config::expand_path(path);
    let file = dir.join(ADAPTER_CONFIG);
    let spec = LoraSpec::from_adapter_config(&file)
        .with_context(|| format!("model.lora_adapter_path={path}"))?;
    if m.lora_rank != 0 && m.lora_rank as i64 != spec.rank {
        bail!(
            "model.lora_rank={} but the adapter {} has r={}",
            m.lora_rank,
            file.display(),
            spec.rank
        );
    }
    if m.lora_alpha != ModelSection::default().lora_alpha && m.lora_alpha != spec.alpha {
        bail!(
            "model.lora_alpha={} but the adapter {} has lora_alpha={}",
            m.lora_alpha,
            file.display(),
            spec.alpha
        );
    }
    Ok(Some((spec, Some(dir))))
}
