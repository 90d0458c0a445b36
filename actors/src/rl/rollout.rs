//! The rollout actor: a [`RolloutModel`] on its process's device, built from a Hugging Face model folder. It
//! generates ([`Generate`]: `n` seeded samples per prompt, one batch) and takes new weights ([`LoadWeights`]: the
//! model is rebuilt from the payload's tensors, every parameter replaced). Compute runs on a blocking thread so the
//! worker's connections stay responsive.

use super::messages::{Generate, Generations, LoadWeights, WeightsLoaded, WeightsSource};
use super::weights::params_in_layout;
use super::{on_state, set_threads};
use anyhow::{Context as _, Result};
use ferl_runtime::{Actor, Context, Handler};
use ferl_trainer::model::layout::ModelLayout;
use ferl_trainer::rollout::{parse_device, parse_dtype, GenerationConfig, RolloutModel};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// Constructor arguments of [`Rollout`].
#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Debug, Clone)]
pub struct RolloutArgs {
    /// The Hugging Face model folder (config.json and safetensors).
    pub model_dir: String,
    /// `cpu`, `cuda` or `cuda:N`.
    pub device: String,
    /// The compute dtype: `fp32` or `bf16`.
    pub dtype: String,
    /// torch's intra-op threads in the actor's process (0: torch's default).
    pub threads: u64,
}

/// The model and the layout its weight syncs are read in.
pub(crate) struct RolloutState {
    layout: ModelLayout,
    model: RolloutModel,
}

impl RolloutState {
    /// Loads `args.model_dir` onto the actor's device.
    pub(crate) fn load(args: &RolloutArgs) -> Result<Self> {
        set_threads(args.threads);
        let (device, kind) = (parse_device(&args.device)?, parse_dtype(&args.dtype)?);
        let dir = Path::new(&args.model_dir);
        let loaded = ferl_trainer::model::load_model(dir)?;
        let model =
            RolloutModel::from_params(loaded.config, &loaded.layout, &loaded.params, device, kind)?;
        Ok(Self {
            layout: loaded.layout,
            model,
        })
    }

    /// `m.n` responses per prompt, in one batch.
    pub(crate) fn generate(&self, m: &Generate) -> Result<Generations> {
        let n = m.n as usize;
        let expanded: Vec<Vec<i64>> = m
            .prompts
            .iter()
            .flat_map(|p| std::iter::repeat_n(p.clone(), n))
            .collect();
        let config = GenerationConfig {
            max_response_length: m.max_response_length as usize,
            sampling: m.sampling.into(),
            eos_token_ids: m.eos_token_ids.clone(),
            pad_token_id: m.pad_token_id,
            first_row: m.first_row,
        };
        let mut out = Generations::default();
        for g in self.model.generate(&expanded, &config)? {
            out.responses.push(g.response);
            out.log_probs.push(g.log_probs);
            out.stopped_at_eos.push(g.stopped_at_eos);
        }
        Ok(out)
    }

    /// Writes the blob's weights into the model's own tensors (cast to its dtype and device), reading them in
    /// place from `data` (a mapped object is not copied first).
    pub(crate) fn load_weights(&mut self, m: &LoadWeights, data: &[u8]) -> Result<()> {
        m.header.with_views(data, |named| {
            let params = params_in_layout(&self.layout, named)?;
            self.model.copy_params_from(&self.layout, &params)
        })
    }
}

/// A rollout worker hosted by the runtime (verl's rollout engine, one per bundle of the rollout group).
pub struct Rollout {
    state: Arc<Mutex<RolloutState>>,
}

impl Actor for Rollout {
    type Args = RolloutArgs;
    const NAME: &'static str = "ferl.actors.Rollout";
    async fn start(args: RolloutArgs, _: &Context) -> Result<Self> {
        let state = tokio::task::spawn_blocking(move || {
            RolloutState::load(&args)
                .with_context(|| format!("rollout: loading the model {}", args.model_dir))
        })
        .await
        .context("rollout: start task")??;
        Ok(Self {
            state: Arc::new(Mutex::new(state)),
        })
    }
}

impl Handler<Generate> for Rollout {
    async fn handle(&self, m: Generate, _: &Context) -> Result<Generations> {
        on_state(&self.state, "rollout: generate", move |s| s.generate(&m)).await
    }
}

impl Handler<LoadWeights> for Rollout {
    async fn handle(&self, m: LoadWeights, ctx: &Context) -> Result<WeightsLoaded> {
        let started = Instant::now();
        let data = match &m.source {
            WeightsSource::Inline(bytes) => bytes.clone(),
            WeightsSource::Object(object) => ctx
                .cluster()
                .get(object)
                .await
                .context("rollout: fetching the weights")?,
        };
        let fetch_seconds = started.elapsed().as_secs_f64();
        let bytes = data.len() as u64;
        let build_seconds = on_state(&self.state, "rollout: load weights", move |s| {
            let started = Instant::now();
            s.load_weights(&m, &data)?;
            Ok(started.elapsed().as_secs_f64())
        })
        .await?;
        Ok(WeightsLoaded {
            bytes,
            fetch_seconds,
            build_seconds,
        })
    }
}
