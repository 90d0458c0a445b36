//! Flat sharding units: the model's tensors grouped per stage into one flat fp32 buffer each, padded so every rank
//! holds an equal slice.
//!
//! # Invariants
//! 1. Every tensor of the layout belongs to exactly one unit: the unit of the first stage (in layout order) that uses
//!    it. A tied output matrix therefore lives in the embedding unit and the head stage refers to it there.
//! 2. A unit's flat buffer is its tensors' elements in stage order, back to back, followed by zero padding up to
//!    `padded = ceil(numel / (world * row_len)) * world * row_len`; rank `r` owns `[r * shard, (r + 1) * shard)` with
//!    `shard = padded / world`.
//!    Under HSDP `world` is the shard group's size (`fsdp_size`): each shard group holds a whole copy.
//! 3. Padding elements have zero value and zero gradient forever (AdamW keeps zeros at zero).
//! 4. A stage's trainable and frozen tensors (LoRA's adapters and its frozen base) are separate units (the adapters'
//!    unit is named `{stage}.adapters`), and every trainable unit comes before every frozen one, so the optimizer's
//!    state covers a prefix of the units.
//! 5. The vocabulary matrices are cut by rows: the embedding's `[vocab, hidden]` matrix (tied or not) and an untied
//!    head's output matrix (unit `head.output`) are each alone in their unit, with `row_len = hidden`, so every rank's
//!    shard holds whole rows of them at any world size (`crate::row_split`). Every other unit has `row_len = 1`.

use ferl_trainer::model::layout::{ModelLayout, Stage};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use tch::{Kind, Tensor};

/// One tensor's place inside a unit's flat buffer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FlatEntry {
    /// Hugging Face name of the tensor.
    pub name: String,
    /// Index into `ModelLayout::tensors`.
    pub layout_index: usize,
    /// Shape of the tensor.
    pub shape: Vec<i64>,
    /// First element inside the flat buffer.
    pub offset: i64,
    /// Number of elements.
    pub numel: i64,
}

/// The tensors sharded together as one flat buffer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FlatUnit {
    /// Name of the unit (`embedding`, `layers.3`, `head`).
    pub name: String,
    /// Member tensors in flat order.
    pub entries: Vec<FlatEntry>,
    /// Elements of all members (unpadded).
    pub numel: i64,
    /// Its tensors never train (the base model under LoRA): no gradients, no optimizer state.
    #[serde(default)]
    pub frozen: bool,
    /// Shards are cut at multiples of this many elements (invariant 5: a vocabulary matrix's row length; else 1).
    #[serde(default = "one_element", skip_serializing_if = "is_one_element")]
    pub row_len: i64,
}

fn one_element() -> i64 {
    1
}

fn is_one_element(n: &i64) -> bool {
    *n == 1
}

impl FlatUnit {
    fn new(name: String, frozen: bool) -> Self {
        Self {
            name,
            entries: Vec::new(),
            numel: 0,
            frozen,
            row_len: 1,
        }
    }

    fn push(&mut self, name: &str, layout_index: usize, shape: &[i64]) -> usize {
        let numel: i64 = shape.iter().product();
        self.entries.push(FlatEntry {
            name: name.to_string(),
            layout_index,
            shape: shape.to_vec(),
            offset: self.numel,
            numel,
        });
        self.numel += numel;
        self.entries.len() - 1
    }

    /// Elements after padding to a multiple of `world` whole rows (invariant 2).
    pub fn padded(&self, world: usize) -> i64 {
        let step = world as i64 * self.row_len.max(1);
        (self.numel + step - 1) / step * step
    }

    /// Elements of one rank's shard at `world` ranks.
    pub fn shard_len(&self, world: usize) -> i64 {
        self.padded(world) / world as i64
    }

    /// Flattens `parts` (one per entry, in entry order; `None` or undefined means zeros) into one padded 1-D tensor
    /// of `kind` on `device`.
    pub fn flatten(
        &self,
        parts: &[Option<&Tensor>],
        world: usize,
        kind: Kind,
        device: tch::Device,
    ) -> Tensor {
        let out = Tensor::zeros([self.padded(world)], (kind, device));
        let _g = tch::no_grad_guard();
        for (e, part) in self.entries.iter().zip(parts) {
            if let Some(t) = part.filter(|t| t.defined()) {
                let mut dst = out.narrow(0, e.offset, e.numel);
                dst.copy_(&t.reshape([-1]));
            }
        }
        out
    }

    /// [`FlatUnit::flatten`] for gradients the caller hands over: a unit of one entry that needs no padding, given a
    /// contiguous gradient of `kind` on `device`, is reduced in place of a copy (the tied embedding's `[V, H]`
    /// gradient is the largest single buffer of a step: its copy was the head's peak).
    pub fn flatten_grads(
        &self,
        parts: &[Option<&Tensor>],
        world: usize,
        kind: Kind,
        device: tch::Device,
    ) -> Tensor {
        if let [Some(t)] = parts {
            let as_is = t.defined()
                && self.entries.len() == 1
                && self.padded(world) == t.numel() as i64
                && t.kind() == kind
                && t.device() == device
                && t.is_contiguous();
            if as_is {
                return t.detach().reshape([-1]);
            }
        }
        self.flatten(parts, world, kind, device)
    }

    /// The view of entry `i` inside `flat` (a full, possibly padded flat buffer of this unit).
    pub fn view(&self, flat: &Tensor, i: usize) -> Tensor {
        let e = &self.entries[i];
        flat.narrow(0, e.offset, e.numel).view(e.shape.as_slice())
    }
}

/// Units of a model and, per stage, where each of its tensors lives.
#[derive(Clone, Debug)]
pub struct UnitPlan {
    /// Units in layout stage order.
    pub units: Vec<FlatUnit>,
    /// Per stage: for each tensor the stage takes, `(unit, entry)`.
    pub stage_refs: HashMap<Stage, Vec<(usize, usize)>>,
    /// Per stage: the distinct units it touches, in first-use order.
    pub stage_units: HashMap<Stage, Vec<usize>>,
}

/// Invariant 5: the unit of the embedding's matrix and that of the head's output matrix, each alone in its unit, are
/// cut on whole rows.
fn cut_vocabulary_by_rows(
    layout: &ModelLayout,
    owner: &HashMap<usize, (usize, usize)>,
    units: &mut [FlatUnit],
) {
    let matrices = layout.stages.iter().filter_map(|(stage, ids)| match stage {
        Stage::Embedding => ids.first(),
        Stage::Head => ids.get(1),
        Stage::Decoder(_) => None,
    });
    for i in matrices {
        let unit = &mut units[owner[i].0];
        if let [only] = &unit.entries[..] {
            if let [_, hidden] = only.shape[..] {
                unit.row_len = hidden.max(1);
            }
        }
    }
}

/// The name a stage's unit gets.
pub fn unit_name(stage: Stage) -> String {
    match stage {
        Stage::Embedding => "embedding".into(),
        Stage::Decoder(l) => format!("layers.{l}"),
        Stage::Head => "head".into(),
    }
}

impl UnitPlan {
    /// Groups `layout`'s tensors into units (invariants 1, 4 and 5).
    pub fn new(layout: &ModelLayout) -> Self {
        let mut owner: HashMap<usize, (usize, usize)> = HashMap::new();
        let mut units: Vec<FlatUnit> = Vec::new();
        for (stage, ids) in &layout.stages {
            let mut fresh: Vec<usize> = ids
                .iter()
                .copied()
                .filter(|i| !owner.contains_key(i))
                .collect();
            // Invariant 5: an untied head's output matrix is a unit of its own.
            let matrix = match stage {
                Stage::Head => ids.get(1).copied().filter(|i| fresh.contains(i)),
                _ => None,
            };
            fresh.retain(|&i| Some(i) != matrix);
            let (train, frozen): (Vec<usize>, Vec<usize>) =
                fresh.iter().partition(|&&i| layout.trainable[i]);
            let mixed = !train.is_empty() && !frozen.is_empty();
            for (group, is_frozen) in [(frozen, true), (train, false)] {
                if group.is_empty() {
                    continue;
                }
                let name = match mixed && !is_frozen {
                    true => format!("{}.adapters", unit_name(*stage)),
                    false => unit_name(*stage),
                };
                let mut unit = FlatUnit::new(name, is_frozen);
                for i in group {
                    let (name, shape) = &layout.tensors[i];
                    owner.insert(i, (units.len(), unit.push(name, i, shape)));
                }
                units.push(unit);
            }
            if let Some(i) = matrix {
                let name = format!("{}.output", unit_name(*stage));
                let mut unit = FlatUnit::new(name, !layout.trainable[i]);
                let (name, shape) = &layout.tensors[i];
                owner.insert(i, (units.len(), unit.push(name, i, shape)));
                units.push(unit);
            }
        }
        cut_vocabulary_by_rows(layout, &owner, &mut units);
        // Invariant 4: trainable units first, each group in stage order.
        let mut order: Vec<usize> = (0..units.len()).collect();
        order.sort_by_key(|&u| units[u].frozen);
        let mut new_id = vec![0; units.len()];
        for (new, &old) in order.iter().enumerate() {
            new_id[old] = new;
        }
        let mut slots: Vec<Option<FlatUnit>> = units.into_iter().map(Some).collect();
        let units = order
            .iter()
            .map(|&u| slots[u].take().expect("moved once"))
            .collect();
        let mut stage_refs = HashMap::new();
        let mut stage_units = HashMap::new();
        for (stage, ids) in &layout.stages {
            let refs: Vec<(usize, usize)> = ids
                .iter()
                .map(|i| (new_id[owner[i].0], owner[i].1))
                .collect();
            let mut touched: Vec<usize> = Vec::new();
            for (u, _) in &refs {
                if !touched.contains(u) {
                    touched.push(*u);
                }
            }
            stage_refs.insert(*stage, refs);
            stage_units.insert(*stage, touched);
        }
        Self {
            units,
            stage_refs,
            stage_units,
        }
    }

    /// Number of units that train; they come first (invariant 4).
    pub fn trainable_units(&self) -> usize {
        self.units.iter().take_while(|u| !u.frozen).count()
    }

    /// Flattens full tensors in layout order into one unpadded-plus-padding flat buffer per unit (fp32, CPU).
    pub fn flatten_full(&self, full: &[Tensor], world: usize) -> Vec<Tensor> {
        self.units
            .iter()
            .map(|u| {
                let parts: Vec<Option<&Tensor>> = u
                    .entries
                    .iter()
                    .map(|e| Some(&full[e.layout_index]))
                    .collect();
                u.flatten(&parts, world, Kind::Float, tch::Device::Cpu)
            })
            .collect()
    }

    /// Splits unit flat buffers back into full tensors in layout order (`count` = number of layout tensors).
    pub fn unflatten(&self, flats: &[Tensor], count: usize) -> Vec<Tensor> {
        let mut out: Vec<Option<Tensor>> = (0..count).map(|_| None).collect();
        for (u, flat) in self.units.iter().zip(flats) {
            for (i, e) in u.entries.iter().enumerate() {
                out[e.layout_index] = Some(u.view(flat, i).copy());
            }
        }
        out.into_iter()
            .map(|t| t.expect("every layout tensor belongs to a unit"))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferl_trainer::model::config::ModelConfig;

    fn layout(tie: bool) -> ModelLayout {
        let raw = serde_json::json!({
            "model_type": "qwen2", "hidden_size": 8, "num_attention_heads": 2, "num_key_value_heads": 1,
            "intermediate_size": 12, "num_hidden_layers": 2, "vocab_size": 11, "tie_word_embeddings": tie,
            "rms_norm_eps": 1e-6, "rope_theta": 10000.0
        });
        ModelLayout::new(&ModelConfig::from_value(raw, std::path::Path::new("test")).unwrap())
    }

    #[test]
    fn every_tensor_has_one_unit_and_tied_head_refers_to_the_embedding_unit() {
        for tie in [true, false] {
            let l = layout(tie);
            let plan = UnitPlan::new(&l);
            let total: i64 = plan.units.iter().map(|u| u.numel).sum();
            assert_eq!(total, l.num_params());
            let head = &plan.stage_units[&Stage::Head];
            if tie {
                assert_eq!(
                    head,
                    &vec![3, 0],
                    "tied head touches its own unit and the embedding unit"
                );
            } else {
                assert_eq!(
                    head,
                    &vec![3, 4],
                    "untied head: its norm's unit and its output matrix's"
                );
                assert_eq!(plan.units[4].name, "head.output");
            }
        }
    }

    #[test]
    fn vocabulary_matrices_are_cut_on_whole_rows_at_any_world_size() {
        for tie in [true, false] {
            let plan = UnitPlan::new(&layout(tie));
            let cut: Vec<&str> = plan
                .units
                .iter()
                .filter(|u| u.row_len == 8)
                .map(|u| u.name.as_str())
                .collect();
            let want = match tie {
                true => vec!["embedding"],
                false => vec!["embedding", "head.output"],
            };
            assert_eq!(cut, want);
            assert!(plan.units.iter().all(|u| u.row_len == 1 || u.row_len == 8));
            for u in plan.units.iter().filter(|u| u.row_len == 8) {
                for world in 1..=8 {
                    let shard = u.shard_len(world);
                    assert_eq!(shard % 8, 0, "{} at world {world}", u.name);
                    assert!(u.padded(world) >= u.numel);
                    assert!(u.padded(world) - u.numel < world as i64 * 8);
                }
            }
        }
    }

    #[test]
    fn flatten_then_unflatten_round_trips_and_pads_with_zeros() {
        let l = layout(false);
        let plan = UnitPlan::new(&l);
        let full: Vec<Tensor> = l
            .tensors
            .iter()
            .map(|(_, s)| Tensor::randn(s.as_slice(), (Kind::Float, tch::Device::Cpu)))
            .collect();
        let flats = plan.flatten_full(&full, 3);
        for (u, f) in plan.units.iter().zip(&flats) {
            assert_eq!(f.numel() as i64, u.padded(3));
            assert_eq!(u.padded(3) % 3, 0);
            let pad = f.narrow(0, u.numel, u.padded(3) - u.numel);
            assert_eq!(pad.abs().sum(Kind::Float).double_value(&[]), 0.0);
        }
        let back = plan.unflatten(&flats, full.len());
        for (a, b) in full.iter().zip(&back) {
            assert!(a.equal(b));
        }
    }

    #[test]
    fn a_lone_unpadded_gradient_is_reduced_in_place_and_anything_else_is_copied() {
        let l = layout(true);
        let plan = UnitPlan::new(&l);
        let emb = &plan.units[0]; // the tied embedding unit: one [11, 8] entry
        assert_eq!(emb.entries.len(), 1);
        let cpu = tch::Device::Cpu;
        let g = Tensor::randn([11, 8], (Kind::Float, cpu));
        let same = emb.flatten_grads(&[Some(&g)], 1, Kind::Float, cpu);
        assert_eq!(
            same.data_ptr(),
            g.data_ptr(),
            "88 elements need no padding at 1 rank"
        );
        let padded = emb.flatten_grads(&[Some(&g)], 2, Kind::Float, cpu);
        assert_ne!(padded.data_ptr(), g.data_ptr());
        assert_eq!(padded.numel(), 96, "11 rows of 8 padded to 12 at 2 ranks");
        assert!(padded.narrow(0, 0, 88).equal(&g.reshape([-1])));
        let cast = emb.flatten_grads(&[Some(&g)], 1, Kind::BFloat16, cpu);
        assert_eq!(cast.kind(), Kind::BFloat16);
        let strided = g.tr().contiguous().tr();
        let copied = emb.flatten_grads(&[Some(&strided)], 1, Kind::Float, cpu);
        assert_ne!(copied.data_ptr(), strided.data_ptr());
        assert!(
            copied.equal(&g.reshape([-1])),
            "a transposed view is copied in row order"
        );
        let layer = &plan.units[1]; // several entries: always one new buffer
        let parts: Vec<Tensor> = layer
            .entries
            .iter()
            .map(|e| Tensor::ones(e.shape.as_slice(), (Kind::Float, cpu)))
            .collect();
        let refs: Vec<Option<&Tensor>> = parts.iter().map(Some).collect();
        let flat = layer.flatten_grads(&refs, 1, Kind::Float, cpu);
        assert_eq!(flat.numel() as i64, layer.numel);
        assert_eq!(flat.sum(Kind::Float).double_value(&[]), layer.numel as f64);
    }
}
