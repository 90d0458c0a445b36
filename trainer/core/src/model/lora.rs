//! LoRA as PEFT does it: a projection `y = x·Wᵀ + b` becomes `y + (α/r)·(x·Aᵀ)·Bᵀ` with `A: [r, in]` and
//! `B: [out, r]`; the base model is frozen and only `A`, `B` train.
//!
//! - [`LoraSpec`]: verl's keys (`model.lora_rank`, `lora_alpha`, `target_modules`, `exclude_modules`) or a PEFT
//!   `adapter_config.json`; which of the seven decoder projections it adapts (PEFT's matching: `all-linear`, or names
//!   matched against the end of each module's path).
//! - [`ModelLayout::add_lora`]: appends the adapters to each decoder stage and freezes everything else.
//! - [`init_adapters`] (PEFT's defaults: Kaiming-uniform `A`, zero `B`), [`load_adapter`], [`write_adapter`] (PEFT's
//!   file names) and [`merge`] (`W + (α/r)·B·A`, what `merge_and_unload()` computes).

use super::config::ModelConfig;
use super::layout::{DecoderParam, ModelLayout, Stage};
use super::weights::{read_tensors, write_safetensors};
use anyhow::{bail, Context, Result};
use serde_json::{json, Value};
use std::path::Path;
use tch::{Kind, Tensor};

/// The PEFT adapter's config file.
pub const ADAPTER_CONFIG: &str = "adapter_config.json";
/// The PEFT adapter's weights file.
pub const ADAPTER_WEIGHTS: &str = "adapter_model.safetensors";
/// The folder of a checkpoint that holds its LoRA adapter in PEFT's format (as verl names it).
pub const CHECKPOINT_ADAPTER_DIR: &str = "lora_adapter";
/// PEFT's shorthand for every linear layer but the output layer (verl's default `target_modules`).
pub const ALL_LINEAR: &str = "all-linear";
/// The prefix PEFT puts before the base model's module names in adapter files.
const PEFT_PREFIX: &str = "base_model.model.";

/// A decoder layer's linear projections, the modules LoRA can adapt.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Proj {
    /// `self_attn.q_proj`
    Q,
    /// `self_attn.k_proj`
    K,
    /// `self_attn.v_proj`
    V,
    /// `self_attn.o_proj`
    O,
    /// `mlp.gate_proj`
    Gate,
    /// `mlp.up_proj`
    Up,
    /// `mlp.down_proj`
    Down,
}

/// Every projection, in the order adapters are laid out.
pub const PROJECTIONS: [Proj; 7] = [
    Proj::Q,
    Proj::K,
    Proj::V,
    Proj::O,
    Proj::Gate,
    Proj::Up,
    Proj::Down,
];

impl Proj {
    /// The module's path inside a decoder layer (`self_attn.q_proj`).
    pub fn module(self) -> &'static str {
        match self {
            Proj::Q => "self_attn.q_proj",
            Proj::K => "self_attn.k_proj",
            Proj::V => "self_attn.v_proj",
            Proj::O => "self_attn.o_proj",
            Proj::Gate => "mlp.gate_proj",
            Proj::Up => "mlp.up_proj",
            Proj::Down => "mlp.down_proj",
        }
    }

    fn index(self) -> usize {
        PROJECTIONS.iter().position(|p| *p == self).expect("listed")
    }
}

/// Where a decoder stage's adapters sit in its parameter list: `(A, B)` per adapted projection, and `α/r`.
#[derive(Clone, Copy, Debug, Default)]
pub struct LoraSlots {
    slots: [Option<(usize, usize)>; 7],
    /// The update's scale, `lora_alpha / lora_rank`.
    pub scale: f64,
}

impl LoraSlots {
    /// `(A, B)` of `proj` when it is adapted.
    pub fn get(&self, proj: Proj) -> Option<(usize, usize)> {
        self.slots[proj.index()]
    }

    /// The adapters' positions of `projs`, `A` then `B` for each adapted one.
    pub fn params(&self, projs: &[Proj]) -> Vec<usize> {
        projs
            .iter()
            .filter_map(|p| self.get(*p))
            .flat_map(|(a, b)| [a, b])
            .collect()
    }

    /// Whether any projection is adapted.
    pub fn is_empty(&self) -> bool {
        self.slots.iter().all(Option::is_none)
    }
}

/// Which LoRA to train: rank, alpha and the modules adapted.
#[derive(Clone, Debug, PartialEq)]
pub struct LoraSpec {
    /// `r`, the adapters' inner width.
    pub rank: i64,
    /// `lora_alpha`; updates are scaled by `alpha / rank`.
    pub alpha: f64,
    /// `all-linear` or module names (matched against the end of each module's path).
    pub targets: Vec<String>,
    /// Module names never adapted (same matching).
    pub exclude: Vec<String>,
}

/// PEFT's rule for a list entry: the module's path is the name or ends with `.name`.
fn matches(path: &str, name: &str) -> bool {
    path == name || path.ends_with(&format!(".{name}"))
}

impl LoraSpec {
    /// `alpha / rank`.
    pub fn scale(&self) -> f64 {
        self.alpha / self.rank as f64
    }

    fn targeted(&self, path: &str) -> bool {
        let wanted = self
            .targets
            .iter()
            .any(|t| t == ALL_LINEAR || matches(path, t));
        wanted && !self.exclude.iter().any(|e| matches(path, e))
    }

    /// The projections adapted in every decoder layer. Fails when a target names no module of the model (as PEFT
    /// does), names one LoRA cannot adapt here (embeddings, `lm_head`), or adapts only some layers.
    pub fn projections(&self, num_layers: usize) -> Result<Vec<Proj>> {
        if self.rank <= 0 {
            bail!("model.lora_rank={}: must be positive", self.rank);
        }
        let path = |l: usize, p: Proj| format!("model.layers.{l}.{}", p.module());
        for t in self.targets.iter().filter(|t| *t != ALL_LINEAR) {
            if ["lm_head", "embed_tokens"]
                .iter()
                .any(|m| matches(m, t) || t.ends_with(m))
            {
                bail!("model.target_modules: `{t}` is not supported (ferl adapts the decoder's linear projections: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj)");
            }
            let found =
                (0..num_layers).any(|l| PROJECTIONS.iter().any(|p| matches(&path(l, *p), t)));
            if !found {
                bail!("model.target_modules: `{t}` matches no module of the model (modules: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, also as model.layers.N.self_attn.q_proj)");
            }
        }
        let first: Vec<Proj> = PROJECTIONS
            .into_iter()
            .filter(|p| self.targeted(&path(0, *p)))
            .collect();
        for l in 1..num_layers {
            let here: Vec<Proj> = PROJECTIONS
                .into_iter()
                .filter(|p| self.targeted(&path(l, *p)))
                .collect();
            if here != first {
                bail!("model.target_modules/exclude_modules adapt different projections in layer 0 and layer {l}; ferl adapts the same projections in every layer");
            }
        }
        if first.is_empty() {
            bail!(
                "model.target_modules={:?} with exclude_modules={:?} leaves nothing to adapt",
                self.targets,
                self.exclude
            );
        }
        Ok(first)
    }

    /// The spec of a PEFT `adapter_config.json`; fails naming any field whose value ferl cannot honour.
    pub fn from_adapter_config(file: &Path) -> Result<Self> {
        let text =
            std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?;
        let v: Value =
            serde_json::from_str(&text).with_context(|| format!("parsing {}", file.display()))?;
        let field = |k: &str| v.get(k).filter(|x| !x.is_null());
        if let Some(t) = field("peft_type").and_then(Value::as_str) {
            if t != "LORA" {
                bail!("{}: peft_type `{t}` is not LoRA", file.display());
            }
        }
        let refuse = |k: &str, ok: &dyn Fn(&Value) -> bool| -> Result<()> {
            match field(k) {
                Some(x) if !ok(x) => bail!("{}: `{k}: {x}` is not supported", file.display()),
                _ => Ok(()),
            }
        };
        let empty = |x: &Value| {
            x.as_object().is_some_and(|o| o.is_empty())
                || x.as_array().is_some_and(|a| a.is_empty())
        };
        refuse("use_rslora", &|x| x == &json!(false))?;
        refuse("use_dora", &|x| x == &json!(false))?;
        refuse("bias", &|x| x == "none")?;
        refuse("fan_in_fan_out", &|x| x == &json!(false))?;
        refuse("lora_dropout", &|x| x.as_f64() == Some(0.0))?;
        for k in [
            "rank_pattern",
            "alpha_pattern",
            "layers_to_transform",
            "modules_to_save",
        ] {
            refuse(k, &empty)?;
        }
        let names = |k: &str| -> Vec<String> {
            match field(k) {
                Some(Value::String(s)) => vec![s.clone()],
                Some(Value::Array(a)) => a
                    .iter()
                    .filter_map(|x| x.as_str().map(String::from))
                    .collect(),
                _ => Vec::new(),
            }
        };
        if let Some(Value::String(s)) = field("target_modules") {
            if s != ALL_LINEAR {
                bail!("{}: target_modules as the regular expression `{s}` is not supported (give a list of names)", file.display());
            }
        }
        Ok(Self {
            rank: field("r")
                .and_then(Value::as_i64)
                .with_context(|| format!("{}: no integer `r`", file.display()))?,
            alpha: field("lora_alpha")
                .and_then(Value::as_f64)
                .with_context(|| format!("{}: no `lora_alpha`", file.display()))?,
            targets: names("target_modules"),
            exclude: names("exclude_modules"),
        })
    }
}

impl DecoderParam {
    /// Position of `proj`'s weight in a decoder stage's list.
    pub fn weight(&self, proj: Proj) -> usize {
        match proj {
            Proj::Q => self.q.0,
            Proj::K => self.k.0,
            Proj::V => self.v.0,
            Proj::O => self.o.0,
            Proj::Gate => self.gate,
            Proj::Up => self.up,
            Proj::Down => self.down,
        }
    }
}

impl ModelLayout {
    /// Appends LoRA adapters of `projs` (`A: [rank, in]`, `B: [out, rank]`, named
    /// `model.layers.N.self_attn.q_proj.lora_A.weight`) to every decoder stage and freezes every other tensor.
    pub fn add_lora(&mut self, spec: &LoraSpec, projs: &[Proj]) {
        for t in &mut self.trainable {
            *t = false;
        }
        let mut slots = LoraSlots {
            scale: spec.scale(),
            ..Default::default()
        };
        for (stage, ids) in &mut self.stages {
            let Stage::Decoder(l) = *stage else { continue };
            for &p in projs {
                let shape = &self.tensors[ids[self.decoder.weight(p)]].1;
                let (out, inp) = (shape[0], shape[1]);
                let base = format!("model.layers.{l}.{}", p.module());
                let a = (format!("{base}.lora_A.weight"), vec![spec.rank, inp]);
                let b = (format!("{base}.lora_B.weight"), vec![out, spec.rank]);
                slots.slots[p.index()] = Some((ids.len(), ids.len() + 1));
                for t in [a, b] {
                    ids.push(self.tensors.len());
                    self.tensors.push(t);
                    self.trainable.push(true);
                }
            }
        }
        self.decoder.lora = slots;
    }

    /// Global indices `(W, A, B)` of every adapted projection.
    pub fn lora_pairs(&self) -> Vec<(usize, usize, usize)> {
        let d = self.decoder;
        let mut out = Vec::new();
        for (stage, ids) in &self.stages {
            if !matches!(stage, Stage::Decoder(_)) {
                continue;
            }
            for p in PROJECTIONS {
                if let Some((a, b)) = d.lora.get(p) {
                    let w = d.weight(p);
                    out.push((ids[w], ids[a], ids[b]));
                }
            }
        }
        out
    }

    /// Number of tensors of the base model (adapters are appended after them).
    pub fn base_len(&self) -> usize {
        self.tensors.len() - 2 * self.lora_pairs().len()
    }
}

/// PEFT's fresh adapters: `A` Kaiming-uniform with `a = √5` (uniform in `±1/√in`), `B` zero; seeded.
pub fn init_adapters(layout: &ModelLayout, params: &mut Vec<Tensor>, seed: i64) {
    tch::manual_seed(seed);
    for i in params.len()..layout.tensors.len() {
        let (name, shape) = &layout.tensors[i];
        let t = if name.ends_with("lora_A.weight") {
            let bound = 1.0 / (shape[1] as f64).sqrt();
            Tensor::empty(shape.as_slice(), (Kind::Float, tch::Device::Cpu)).uniform_(-bound, bound)
        } else {
            Tensor::zeros(shape.as_slice(), (Kind::Float, tch::Device::Cpu))
        };
        params.push(t);
    }
}

/// Appends the adapters of the PEFT folder `dir` to `params` (fp32), checking names and shapes against `layout`.
pub fn load_adapter(dir: &Path, layout: &ModelLayout, params: &mut Vec<Tensor>) -> Result<()> {
    let file = dir.join(ADAPTER_WEIGHTS);
    let mut named = read_tensors(std::slice::from_ref(&file))?;
    for i in params.len()..layout.tensors.len() {
        let (name, shape) = &layout.tensors[i];
        let peft = format!("{PEFT_PREFIX}{name}");
        let t = named
            .remove(&peft)
            .with_context(|| format!("{}: tensor `{peft}` missing", file.display()))?;
        if t.size() != *shape {
            bail!(
                "{}: tensor `{peft}` has shape {:?}, expected {shape:?}",
                file.display(),
                t.size()
            );
        }
        params.push(t.to_kind(Kind::Float));
    }
    if let Some(extra) = named.keys().next() {
        bail!(
            "{}: tensor `{extra}` is not an adapter of this model and config",
            file.display()
        );
    }
    Ok(())
}

/// Writes a PEFT adapter folder (`adapter_config.json`, `adapter_model.safetensors` in fp32) from the full adapter
/// tensors of a LoRA model (in layout order), as `peft`'s `save_pretrained` names them.
pub fn write_adapter(
    dir: &Path,
    spec: &LoraSpec,
    layout: &ModelLayout,
    adapters: &[Tensor],
    base_model: &str,
) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let names = &layout.tensors[layout.base_len()..];
    if names.len() != adapters.len() {
        bail!(
            "write_adapter: {} tensors for {} adapters",
            adapters.len(),
            names.len()
        );
    }
    let named: Vec<(String, Tensor)> = names
        .iter()
        .zip(adapters)
        .map(|((name, _), t)| (format!("{PEFT_PREFIX}{name}"), t.to_kind(Kind::Float)))
        .collect();
    write_safetensors(&dir.join(ADAPTER_WEIGHTS), &named)?;
    let config = json!({
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "target_modules": peft_target_modules(&spec.targets),
        "exclude_modules": if spec.exclude.is_empty() { Value::Null } else { json!(spec.exclude) },
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": false,
        "use_rslora": false,
        "use_dora": false,
        "init_lora_weights": true,
        "inference_mode": true,
        "modules_to_save": null,
        "layers_to_transform": null,
        "rank_pattern": {},
        "alpha_pattern": {},
    });
    let path = dir.join(ADAPTER_CONFIG);
    std::fs::write(&path, serde_json::to_string_pretty(&config)?)
        .with_context(|| format!("writing {}", path.display()))
}

/// `target_modules` as PEFT reads it: its shorthand `all-linear` only as a string (a list holding it names a module
/// called `all-linear`, which matches nothing), names as a list.
fn peft_target_modules(targets: &[String]) -> Value {
    match targets {
        [one] if one == ALL_LINEAR => json!(ALL_LINEAR),
        names => json!(names),
    }
}

/// The base model's tensors with every adapter merged in, `W + (α/r)·B·A` (fp32), in base layout order.
pub fn merge(layout: &ModelLayout, full: &[Tensor]) -> Vec<Tensor> {
    let _g = tch::no_grad_guard();
    let mut base: Vec<Tensor> = full[..layout.base_len()]
        .iter()
        .map(|t| t.to_kind(Kind::Float))
        .collect();
    let scale = layout.decoder.lora.scale;
    for (w, a, b) in layout.lora_pairs() {
        let delta = full[b]
            .to_kind(Kind::Float)
            .matmul(&full[a].to_kind(Kind::Float))
            * scale;
        base[w] = &base[w] + delta;
    }
    base
}

/// One decoder stage's tensors `stage` (in the stage's order, slots `d`) with its adapters merged into their
/// projections, `W + (α/r)·B·A` computed in fp32 and cast back to `W`'s dtype; the adapter tensors are dropped.
/// Returns the slots of the merged stage (no adapters): what a rollout model generates with, as verl merges the
/// adapters before it syncs the weights into its rollout engine.
pub fn merge_stage(d: &DecoderParam, stage: &mut Vec<Tensor>) -> DecoderParam {
    let _g = tch::no_grad_guard();
    let mut adapters = Vec::new();
    for p in PROJECTIONS {
        let Some((a, b)) = d.lora.get(p) else {
            continue;
        };
        let w = d.weight(p);
        let delta = stage[b]
            .to_kind(Kind::Float)
            .matmul(&stage[a].to_kind(Kind::Float))
            * d.lora.scale;
        stage[w] = (stage[w].to_kind(Kind::Float) + delta).to_kind(stage[w].kind());
        adapters.extend([a, b]);
    }
    // The adapters are the stage's last tensors (appended by `add_lora`).
    stage.truncate(stage.len() - adapters.len());
    d.without_adapters()
}

impl DecoderParam {
    /// These slots with no projection adapted: the base model's forward (verl's reference policy of a LoRA actor,
    /// PEFT's `disable_adapter()`).
    pub fn without_adapters(&self) -> DecoderParam {
        DecoderParam {
            lora: LoraSlots::default(),
            ..*self
        }
    }
}

/// The layout and parameters of `cfg`'s model with LoRA: fresh adapters (seeded) or those of `adapter`.
pub fn with_adapters(
    cfg: &ModelConfig,
    mut layout: ModelLayout,
    mut params: Vec<Tensor>,
    spec: &LoraSpec,
    adapter: Option<&Path>,
    seed: i64,
) -> Result<(ModelLayout, Vec<Tensor>)> {
    let projs = spec.projections(cfg.num_layers)?;
    layout.add_lora(spec, &projs);
    match adapter {
        Some(dir) => load_adapter(dir, &layout, &mut params)?,
        None => init_adapters(&layout, &mut params, seed),
    }
    Ok((layout, params))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::weights::init_params;

    fn config() -> ModelConfig {
        let raw = json!({
            "model_type": "qwen2", "hidden_size": 8, "num_attention_heads": 2, "num_key_value_heads": 1,
            "intermediate_size": 12, "num_hidden_layers": 2, "vocab_size": 11, "tie_word_embeddings": true
        });
        ModelConfig::from_value(raw, Path::new("test")).unwrap()
    }

    fn spec(targets: &[&str], exclude: &[&str]) -> LoraSpec {
        let strings = |v: &[&str]| v.iter().map(|s| s.to_string()).collect();
        LoraSpec {
            rank: 4,
            alpha: 8.0,
            targets: strings(targets),
            exclude: strings(exclude),
        }
    }

    #[test]
    fn targets_match_like_peft_and_mistakes_name_the_module() {
        let all = spec(&["all-linear"], &[]).projections(2).unwrap();
        assert_eq!(all, PROJECTIONS);
        let qv = spec(&["q_proj", "self_attn.v_proj"], &[]).projections(2);
        assert_eq!(qv.unwrap(), [Proj::Q, Proj::V]);
        let no_mlp = spec(&["all-linear"], &["gate_proj", "up_proj", "down_proj"]);
        assert_eq!(
            no_mlp.projections(2).unwrap(),
            [Proj::Q, Proj::K, Proj::V, Proj::O]
        );
        for (bad, want) in [
            (spec(&["lm_head"], &[]), "`lm_head` is not supported"),
            (spec(&["proj"], &[]), "`proj` matches no module"),
            (spec(&["layers.1.mlp.up_proj"], &[]), "layer 0 and layer 1"),
            (spec(&["q_proj"], &["q_proj"]), "leaves nothing to adapt"),
        ] {
            let err = bad.projections(2).unwrap_err().to_string();
            assert!(err.contains(want), "{err}");
        }
    }

    #[test]
    fn adapters_are_appended_trainable_and_merge_into_the_base() {
        let cfg = config();
        let base = ModelLayout::new(&cfg);
        let params = init_params(&cfg, &base, 1);
        let s = spec(&["q_proj", "down_proj"], &[]);
        let (layout, mut params) = with_adapters(&cfg, base.clone(), params, &s, None, 3).unwrap();
        assert_eq!(layout.base_len(), base.tensors.len());
        assert_eq!(layout.tensors.len(), base.tensors.len() + 2 * 2 * 2);
        assert!(layout.trainable[..layout.base_len()].iter().all(|t| !t));
        assert!(layout.trainable[layout.base_len()..].iter().all(|t| *t));
        let (name, shape) = &layout.tensors[layout.base_len()];
        assert_eq!(
            (name.as_str(), shape.as_slice()),
            ("model.layers.0.self_attn.q_proj.lora_A.weight", &[4, 8][..])
        );
        // Fresh: A within ±1/√in, B zero, so merging changes nothing.
        let a = &params[layout.base_len()];
        assert!(a.abs().max().double_value(&[]) <= 1.0 / 8f64.sqrt());
        assert!(merge(&layout, &params)
            .iter()
            .zip(&params)
            .all(|(m, p)| m.equal(p)));
        // With B set, the merged weight is W + (α/r)·B·A.
        let (w, ai, bi) = layout.lora_pairs()[1];
        params[bi] = Tensor::ones(
            layout.tensors[bi].1.as_slice(),
            (Kind::Float, tch::Device::Cpu),
        );
        let want = &params[w] + params[bi].matmul(&params[ai]) * 2.0;
        let got = &merge(&layout, &params)[w];
        assert!((got - want).abs().max().double_value(&[]) < 1e-6);
    }

    #[test]
    fn adapters_round_trip_through_peft_files_and_unsupported_peft_fields_are_refused() {
        let cfg = config();
        let base = ModelLayout::new(&cfg);
        let s = spec(&["all-linear"], &[]);
        let (layout, params) =
            with_adapters(&cfg, base.clone(), init_params(&cfg, &base, 1), &s, None, 3).unwrap();
        let dir = tempfile::tempdir().unwrap();
        write_adapter(dir.path(), &s, &layout, &params[layout.base_len()..], "m").unwrap();
        let written: Value =
            serde_json::from_slice(&std::fs::read(dir.path().join(ADAPTER_CONFIG)).unwrap())
                .unwrap();
        assert_eq!(
            written["target_modules"],
            json!("all-linear"),
            "PEFT reads its shorthand only as a string"
        );
        assert_eq!(
            LoraSpec::from_adapter_config(&dir.path().join(ADAPTER_CONFIG)).unwrap(),
            s
        );
        let (_, back) = with_adapters(
            &cfg,
            base.clone(),
            init_params(&cfg, &base, 1),
            &s,
            Some(dir.path()),
            9,
        )
        .unwrap();
        assert!(back.iter().zip(&params).all(|(a, b)| a.equal(b)));
        let file = dir.path().join(ADAPTER_CONFIG);
        for (field, value) in [
            ("use_dora", json!(true)),
            ("lora_dropout", json!(0.1)),
            ("rank_pattern", json!({"q_proj": 2})),
        ] {
            let mut v: Value = serde_json::from_slice(&std::fs::read(&file).unwrap()).unwrap();
            v[field] = value;
            std::fs::write(&file, v.to_string()).unwrap();
            let err = LoraSpec::from_adapter_config(&file)
                .unwrap_err()
                .to_string();
            assert!(err.contains(field), "{err}");
            v[field] = json!(null);
            std::fs::write(&file, v.to_string()).unwrap();
        }
    }
}
