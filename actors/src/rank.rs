//! One training rank's state, independent of how the rank was started: the model replica, its communicator and the
//! [`Stepper`]. The [`crate::TrainerRank`] actor wraps it for the cluster path; [`crate::sft::run_from_env`] uses
//! it directly for ranks started by torchrun or SLURM.
//!
//! Invariants:
//! 1. A distributed step computes exactly what [`Stepper::step`] computes on the whole global batch in one process:
//!    each rank scales by the *global* target count and the gradients are summed across ranks before the norm.
//! 2. A rank never decides data order: it trains on the samples it is given.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context as _, Result};
use ferl_collective::Communicator;
use ferl_config::{Dtype, SftConfig};
use ferl_trainer::batch::{Layout, MicroBatch, SampleRef};
use ferl_trainer::engine::{Engine, EngineOptions};
use ferl_trainer::model::config::ModelConfig;
use ferl_trainer::model::{load_model, weights};
use ferl_trainer::optim::{clip_grads, AdamW, AdamWConfig, LrSchedule};
use ferl_trainer::params::{LocalParams, ParamStore};
use ferl_trainer::step::Stepper;
use tch::{Device, Kind, Tensor};

use crate::messages::{RankStep, Sample};
use crate::replicated::ReplicatedParams;

/// File a rank writes its model tensors to inside `global_step_N/`.
pub const MODEL_FILE: &str = "model.safetensors";
/// File a rank writes its optimizer moments to inside `global_step_N/`.
pub const OPTIM_FILE: &str = "optim.safetensors";
/// File holding the optimizer's step counters inside `global_step_N/`.
pub const TRAINER_STATE_FILE: &str = "trainer_state.json";

/// The dtype stages compute in: bf16 when `model_dtype` or `mixed_precision.param_dtype` asks for it, else fp32.
pub fn compute_kind(cfg: &SftConfig) -> Kind {
    let fsdp = &cfg.model.fsdp_config;
    let dtype = fsdp.mixed_precision.as_ref().map(|m| m.param_dtype).unwrap_or(fsdp.model_dtype);
    match dtype {
        Dtype::Bf16 => Kind::BFloat16,
        Dtype::Fp16 => Kind::Half,
        Dtype::Fp32 => Kind::Float,
    }
}

/// The device of a rank: CUDA device `local_device` when `trainer.device` is `cuda` and CUDA is available, else the
/// CPU (with a warning when CUDA was asked for).
pub fn rank_device(cfg: &SftConfig, local_device: usize) -> Device {
    if cfg.trainer.device == "cpu" {
        return Device::Cpu;
    }
    if tch::Cuda::is_available() {
        Device::Cuda(local_device)
    } else {
        tracing::warn!(device = %cfg.trainer.device, "CUDA is not available: training on the CPU");
        Device::Cpu
    }
}

/// Optimizer steps of the run: `trainer.total_training_steps`, else `total_epochs` whole epochs of `train_len`.
pub fn total_steps(cfg: &SftConfig, train_len: usize) -> usize {
    cfg.trainer.total_training_steps.unwrap_or_else(|| {
        cfg.trainer.total_epochs * ferl_data::steps_per_epoch(train_len, cfg.data.train_batch_size)
    })
}

/// The model folder named by `model.partial_pretrain`.
pub fn model_dir(cfg: &SftConfig) -> PathBuf {
    ferl_config::expand_path(&cfg.model.partial_pretrain)
}

/// A [`Stepper`] over `store` with the config's optimizer, schedule, clipping and micro-batching.
pub fn build_stepper<P: ParamStore>(
    cfg: &SftConfig,
    model: ModelConfig,
    store: P,
    device: Device,
    total_steps: usize,
) -> Result<Stepper<P>> {
    let o = &cfg.optim;
    let warmup_ratio = if o.lr_warmup_steps >= 0 {
        o.lr_warmup_steps as f64 / total_steps.max(1) as f64
    } else {
        o.lr_warmup_steps_ratio
    };
    let scheduler = match o.lr_scheduler {
        ferl_config::LrScheduler::Cosine => "cosine",
        ferl_config::LrScheduler::Constant => "constant",
    };
    let schedule = LrSchedule::from_verl(scheduler, o.lr, warmup_ratio, total_steps as i64, o.min_lr_ratio)?;
    let mut store = store;
    let optimizer = AdamW::new(
        AdamWConfig { betas: (o.betas[0], o.betas[1]), eps: 1e-8, weight_decay: o.weight_decay },
        store.master_and_grads().0,
    );
    let opts = EngineOptions { gradient_checkpointing: cfg.model.enable_gradient_checkpointing, ..Default::default() };
    Ok(Stepper {
        engine: Engine::new(model, store, compute_kind(cfg), opts),
        optimizer,
        schedule,
        clip_grad: o.clip_grad,
        micro_batch_size: cfg.data.micro_batch_size_per_gpu,
        layout: if cfg.use_remove_padding { Layout::Packed } else { Layout::Padded },
        device,
        completed_steps: 0,
    })
}

/// Loads `model.partial_pretrain` as fp32 masters on `device` in a [`LocalParams`] (the single-process store).
pub fn load_local_params(cfg: &SftConfig, device: Device) -> Result<(ModelConfig, LocalParams)> {
    let dir = model_dir(cfg);
    let loaded = load_model(&dir).with_context(|| format!("model.partial_pretrain={}", dir.display()))?;
    let params = loaded.params.into_iter().map(|t| t.to_device(device)).collect();
    Ok((loaded.config, LocalParams::new(loaded.layout, params, compute_kind(cfg))))
}

/// Borrowed views of wire samples, in order.
pub fn sample_refs(samples: &[Sample]) -> Vec<SampleRef<'_>> {
    samples.iter().map(|s| SampleRef { input_ids: &s.input_ids, loss_mask: &s.loss_mask }).collect()
}

/// One step of data parallelism on this rank's share: micro-batches scaled by `global_targets`, gradients summed
/// across ranks (inside the store's norm), clipping and AdamW as [`Stepper::step`] does them.
pub fn distributed_step<P: ParamStore>(
    stepper: &mut Stepper<P>,
    samples: &[SampleRef<'_>],
    global_targets: i64,
) -> Result<RankStep> {
    let targets: i64 = samples.iter().map(SampleRef::num_targets).sum();
    let tokens: i64 = samples.iter().map(|s| s.input_ids.len() as i64).sum();
    stepper.engine.store_mut().zero_grads();
    let mut loss_sum = 0.0;
    for chunk in samples.chunks(stepper.micro_batch_size.max(1)) {
        let mb = MicroBatch::new(chunk, stepper.layout, stepper.device)?;
        loss_sum += stepper.engine.forward_backward(&mb, global_targets)?;
    }
    let store = stepper.engine.store_mut();
    let grad_norm = store.grad_sq_norm()?.sqrt();
    let lr = stepper.schedule.lr_at(stepper.completed_steps);
    let skipped = !grad_norm.is_finite();
    if skipped {
        tracing::warn!(step = stepper.completed_steps + 1, grad_norm, "non-finite gradient norm: update skipped");
    } else {
        let (master, grads) = store.master_and_grads();
        clip_grads(grads, grad_norm, stepper.clip_grad);
        stepper.optimizer.step(master, grads, lr);
    }
    stepper.completed_steps += 1;
    Ok(RankStep { loss_sum, grad_norm, lr, skipped, tokens, targets, peak_memory_bytes: peak_memory_bytes(stepper.device) })
}

/// Peak memory of this rank: the process's peak resident set (`VmHWM`) on the CPU, the caching allocator's peak on
/// CUDA when torch exposes it through the environment (`0` when unknown).
pub fn peak_memory_bytes(device: Device) -> u64 {
    match device {
        Device::Cpu => std::fs::read_to_string("/proc/self/status")
            .ok()
            .and_then(|s| {
                s.lines()
                    .find(|l| l.starts_with("VmHWM:"))
                    .and_then(|l| l.split_whitespace().nth(1))
                    .and_then(|kb| kb.parse::<u64>().ok())
            })
            .map(|kb| kb * 1024)
            .unwrap_or(0),
        _ => 0,
    }
}

/// A training rank: model replica, communicator and stepper.
pub struct RankState {
    /// The resolved config.
    pub cfg: SftConfig,
    /// The optimizer step machinery over the replicated store.
    pub stepper: Stepper<ReplicatedParams>,
    /// Parameters of the model (for FLOP counts).
    pub num_params: i64,
}

impl RankState {
    /// Loads the model on `device` and joins it to `comm`'s group.
    pub fn build(cfg: SftConfig, comm: Arc<dyn Communicator>, device: Device, total_steps: usize) -> Result<Self> {
        if cfg.model.lora_rank > 0 {
            bail!("model.lora_rank={}: LoRA is not supported by the distributed trainer", cfg.model.lora_rank);
        }
        let (model, local) = load_local_params(&cfg, device)?;
        let num_params = local.layout_ref().num_params();
        let store = ReplicatedParams::new(local, comm);
        let stepper = build_stepper(&cfg, model, store, device, total_steps)?;
        Ok(Self { cfg, stepper, num_params })
    }

    /// This rank's index and the group size.
    pub fn rank_and_world(&self) -> (usize, usize) {
        let comm = self.stepper.engine.store().communicator();
        (comm.rank(), comm.world_size())
    }

    /// Trains on this rank's share of one global batch.
    pub fn train_step(&mut self, samples: &[Sample], global_targets: i64) -> Result<RankStep> {
        distributed_step(&mut self.stepper, &sample_refs(samples), global_targets)
    }

    /// Summed validation cross-entropy and target count over `samples` (no gradients, no collectives).
    pub fn validate(&mut self, samples: &[Sample]) -> Result<(f64, i64)> {
        let refs = sample_refs(samples);
        let (mut sum, mut count) = (0.0, 0);
        for chunk in refs.chunks(self.stepper.micro_batch_size.max(1)) {
            let mb = MicroBatch::new(chunk, self.stepper.layout, self.stepper.device)?;
            let (s, c) = self.stepper.engine.eval_loss(&mb)?;
            sum += s;
            count += c;
        }
        Ok((sum, count))
    }

    fn named(&self, values: &[Tensor], prefix: &str) -> Vec<(String, Tensor)> {
        let layout = self.stepper.engine.store().layout();
        layout.tensors.iter().zip(values).map(|((n, _), t)| (format!("{prefix}{n}"), t.to_device(Device::Cpu))).collect()
    }

    /// Writes this rank's part of a checkpoint into `dir` (with full replicas only rank 0 writes; returns whether
    /// this rank wrote files).
    pub fn save(&mut self, dir: &Path) -> Result<bool> {
        if self.rank_and_world().0 != 0 {
            return Ok(false);
        }
        std::fs::create_dir_all(dir).with_context(|| format!("creating checkpoint folder {}", dir.display()))?;
        let masters = self.named(self.stepper.engine.store().local().master(), "");
        weights::write_safetensors(&dir.join(MODEL_FILE), &masters)?;
        let mut moments = self.named(&self.stepper.optimizer.exp_avg, "exp_avg/");
        moments.extend(self.named(&self.stepper.optimizer.exp_avg_sq, "exp_avg_sq/"));
        weights::write_safetensors(&dir.join(OPTIM_FILE), &moments)?;
        let state = serde_json::json!({
            "optimizer_step": self.stepper.optimizer.step,
            "completed_steps": self.stepper.completed_steps,
        });
        std::fs::write(dir.join(TRAINER_STATE_FILE), serde_json::to_vec_pretty(&state)?)
            .with_context(|| format!("writing {}", dir.join(TRAINER_STATE_FILE).display()))?;
        Ok(true)
    }

    /// Restores model, optimizer and schedule position from the checkpoint folder `dir` (written by any number of
    /// ranks: the files hold whole tensors).
    pub fn load(&mut self, dir: &Path) -> Result<()> {
        let device = self.stepper.device;
        let names: Vec<String> = self.stepper.engine.store().layout().tensors.iter().map(|(n, _)| n.clone()).collect();
        let mut model = weights::read_tensors(&[dir.join(MODEL_FILE)])?;
        let mut optim = weights::read_tensors(&[dir.join(OPTIM_FILE)])?;
        let take = |map: &mut std::collections::HashMap<String, Tensor>, key: String, file: &str| {
            map.remove(&key)
                .map(|t| t.to_device(device))
                .with_context(|| format!("checkpoint {}/{file}: tensor `{key}` is missing", dir.display()))
        };
        let masters = names.iter().map(|n| take(&mut model, n.clone(), MODEL_FILE)).collect::<Result<Vec<_>>>()?;
        let m = names.iter().map(|n| take(&mut optim, format!("exp_avg/{n}"), OPTIM_FILE)).collect::<Result<Vec<_>>>()?;
        let v = names.iter().map(|n| take(&mut optim, format!("exp_avg_sq/{n}"), OPTIM_FILE)).collect::<Result<Vec<_>>>()?;
        let state_file = dir.join(TRAINER_STATE_FILE);
        let state: serde_json::Value = serde_json::from_slice(
            &std::fs::read(&state_file).with_context(|| format!("reading {}", state_file.display()))?,
        )
        .with_context(|| format!("parsing {}", state_file.display()))?;
        let field = |k: &str| {
            state[k].as_i64().with_context(|| format!("{}: `{k}` is missing or not an integer", state_file.display()))
        };
        let (opt_step, completed) = (field("optimizer_step")?, field("completed_steps")?);
        self.stepper.engine.store_mut().local_mut().set_master(&masters);
        let _g = tch::no_grad_guard();
        for (dst, src) in self.stepper.optimizer.exp_avg.iter_mut().zip(&m) {
            dst.copy_(src);
        }
        for (dst, src) in self.stepper.optimizer.exp_avg_sq.iter_mut().zip(&v) {
            dst.copy_(src);
        }
        self.stepper.optimizer.step = opt_step;
        self.stepper.completed_steps = completed;
        Ok(())
    }

    /// Writes a Hugging Face folder (config, safetensors in the model dtype, tokenizer files) to `out` (rank 0 only;
    /// returns whether this rank wrote it).
    pub fn export(&self, out: &Path) -> Result<bool> {
        if self.rank_and_world().0 != 0 {
            return Ok(false);
        }
        let store = self.stepper.engine.store();
        let kind = if self.cfg.model.fsdp_config.model_dtype == Dtype::Bf16 { Kind::BFloat16 } else { Kind::Float };
        let masters: Vec<Tensor> = store.local().master().iter().map(|t| t.to_device(Device::Cpu)).collect();
        let src = model_dir(&self.cfg);
        weights::save_hf_folder(out, self.stepper.engine.config(), store.layout(), &masters, kind, &[src.as_path()])?;
        Ok(true)
    }
}
