//! The batch an RL step passes from stage to stage (verl's `DataProto` of one PPO/GRPO step): per row a prompt, its
//! response and what the reward needs, then what the stages fill in — one reward per row, and per response token the
//! old and reference log-probabilities and the advantages.
//!
//! Per-token data is laid out as verl's `[rows, response_width]` matrices, each row's response tokens left-aligned and
//! zeros after them ([`RlBatch::response_mask`] marks the tokens). For the engine, rows become micro-batches of
//! prompt + response samples whose loss mask is set on the response tokens ([`RlBatch::micro_batch`]): the engine
//! scores token `t` from position `t - 1`, so its target rows are exactly the response tokens, sample by sample and
//! position by position — the row-major order of the masked matrix entries ([`RlBatch::gather_tokens`]).

use anyhow::{bail, Result};
use ferl_trainer::batch::{Layout, MicroBatch, SampleRef};
use ferl_trainer::model::ulysses::SpGroup;
use tch::{Device, Kind, Tensor};

/// One row: a prompt, one response to it and what the reward needs.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RlRow {
    /// Prompt token ids (at least one).
    pub prompt: Vec<i64>,
    /// Response token ids (the EOS token included when one ended it).
    pub response: Vec<i64>,
    /// The group the row belongs to: rows answering the same prompt share it (verl's `uid`).
    pub uid: u64,
    /// The prompt as text, when the caller has a tokenizer (else empty).
    pub prompt_text: String,
    /// The response as text, when the caller has a tokenizer (else empty).
    pub response_text: String,
    /// The reward's ground truth (verl's `reward_model.ground_truth`).
    pub ground_truth: String,
    /// Anything else the reward reads (verl's `extra_info`).
    pub extra: serde_json::Value,
}

/// The rows of one step and what the step's stages computed for them.
#[derive(Debug, Default)]
pub struct RlBatch {
    /// The rows, grouped or not (groups are found by `uid`).
    pub rows: Vec<RlRow>,
    /// One score per row (verl's sequence score: the sum of its token-level rewards).
    pub rewards: Option<Vec<f64>>,
    /// `[rows, width]` log-probabilities of the response tokens under the policy that generated them.
    pub old_log_probs: Option<Tensor>,
    /// `[rows, width]` log-probabilities under the reference policy (with `use_kl_loss`).
    pub ref_log_probs: Option<Tensor>,
    /// `[rows, width]` advantages per response token.
    pub advantages: Option<Tensor>,
}

impl RlBatch {
    /// A batch of `rows` with nothing computed yet.
    pub fn new(rows: Vec<RlRow>) -> Self {
        Self {
            rows,
            ..Self::default()
        }
    }

    /// Number of rows.
    pub fn len(&self) -> usize {
        self.rows.len()
    }

    /// Whether there is no row.
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// Response length of each row.
    pub fn response_lengths(&self) -> Vec<i64> {
        self.rows.iter().map(|r| r.response.len() as i64).collect()
    }

    /// Width of the per-token matrices: the longest response (at least 1).
    pub fn response_width(&self) -> i64 {
        self.response_lengths()
            .into_iter()
            .max()
            .unwrap_or(0)
            .max(1)
    }

    /// Group id of each row.
    pub fn uids(&self) -> Vec<u64> {
        self.rows.iter().map(|r| r.uid).collect()
    }

    /// `[rows, width]` fp32: 1 on each row's response tokens, 0 after them.
    pub fn response_mask(&self, device: Device) -> Tensor {
        let all: Vec<usize> = (0..self.len()).collect();
        self.rows_and_mask(&all, device).1.to_kind(Kind::Float)
    }

    /// verl's `token_level_rewards` without a KL penalty in the reward: each row's reward on its last response token
    /// (`[rows, width]` fp32; a row without response tokens gets none).
    pub fn token_level_rewards(&self, device: Device) -> Result<Tensor> {
        let Some(rewards) = &self.rewards else {
            bail!("the batch has no rewards yet")
        };
        if rewards.len() != self.len() {
            bail!("{} rewards for {} rows", rewards.len(), self.len());
        }
        let width = self.response_width() as usize;
        let mut m = vec![0f32; self.len() * width];
        for (i, (row, &r)) in self.rows.iter().zip(rewards).enumerate() {
            if let Some(last) = row.response.len().checked_sub(1) {
                m[i * width + last] = r as f32;
            }
        }
        Ok(Tensor::from_slice(&m)
            .view([self.len() as i64, width as i64])
            .to_device(device))
    }

    /// The engine's micro-batch of rows `rows` (in that order), padded, on `device`: prompt + response per row with
    /// the loss mask on the response tokens.
    pub fn micro_batch(
        &self,
        rows: &[usize],
        layout: Layout,
        device: Device,
    ) -> Result<MicroBatch> {
        let owned: Vec<(Vec<i64>, Vec<bool>)> = rows
            .iter()
            .map(|&i| {
                let r = &self.rows[i];
                let ids = [r.prompt.as_slice(), &r.response].concat();
                let mask = (0..ids.len()).map(|t| t >= r.prompt.len()).collect();
                (ids, mask)
            })
            .collect();
        if let Some(i) = rows.iter().find(|&&i| self.rows[i].prompt.is_empty()) {
            bail!("row {i} has an empty prompt: nothing predicts its first response token");
        }
        let samples: Vec<SampleRef<'_>> = owned
            .iter()
            .map(|(input_ids, loss_mask)| SampleRef {
                input_ids,
                loss_mask,
            })
            .collect();
        MicroBatch::new(&samples, layout, device)
    }

    /// [`Self::micro_batch`], split over the Ulysses group `sp` when there is one: this rank's slice, with the
    /// positions (in the whole micro-batch's target order, `[k]` int64) of the response tokens it holds.
    pub fn micro_batch_on(
        &self,
        rows: &[usize],
        layout: Layout,
        device: Device,
        sp: Option<&SpGroup>,
    ) -> Result<(MicroBatch, Option<Tensor>)> {
        let mb = self.micro_batch(rows, layout, device)?;
        let Some(group) = sp else {
            return Ok((mb, None));
        };
        let (mb, kept) = mb.sequence_parallel_kept(group)?;
        Ok((mb, Some(Tensor::from_slice(&kept).to_device(device))))
    }

    /// `values` (`[k]`, the response tokens at positions `kept` of rows `rows`' micro-batch, or all of them without
    /// `kept`) as the micro-batch's whole `[n]` token vector, zeros elsewhere.
    pub fn whole_tokens(&self, rows: &[usize], kept: Option<&Tensor>, values: &Tensor) -> Tensor {
        let Some(kept) = kept else {
            return values.shallow_clone();
        };
        let n: i64 = self.tokens_per_row(rows).iter().sum();
        Tensor::zeros([n], (values.kind(), values.device())).index_copy(0, kept, values)
    }

    /// The response tokens of rows `rows` of the `[rows, width]` matrix `m`, flat (`[n]`) in the order of the
    /// micro-batch's target rows.
    pub fn gather_tokens(&self, m: &Tensor, rows: &[usize]) -> Tensor {
        let (idx, mask) = self.rows_and_mask(rows, m.device());
        m.index_select(0, &idx).masked_select(&mask)
    }

    /// Writes `values` (`[n]`, the response tokens of rows `rows` in target-row order) into those rows of the
    /// `[rows, width]` matrix `m`, leaving zeros past each response.
    pub fn scatter_tokens(&self, m: &mut Tensor, rows: &[usize], values: &Tensor) {
        let (idx, mask) = self.rows_and_mask(rows, m.device());
        let sub = Tensor::zeros([rows.len() as i64, m.size()[1]], (m.kind(), m.device()))
            .masked_scatter(&mask, &values.to_kind(m.kind()).to_device(m.device()));
        let _ = m.index_copy_(0, &idx, &sub);
    }

    /// Row indices as a tensor and the response mask of those rows (bool, `[rows.len(), width]`).
    fn rows_and_mask(&self, rows: &[usize], device: Device) -> (Tensor, Tensor) {
        let idx: Vec<i64> = rows.iter().map(|&i| i as i64).collect();
        let idx = Tensor::from_slice(&idx).to_device(device);
        let lens = Tensor::from_slice(&self.tokens_per_row(rows)).to_device(device);
        let cols = Tensor::arange(self.response_width(), (Kind::Int64, device));
        (idx, cols.unsqueeze(0).lt_tensor(&lens.unsqueeze(1)))
    }

    /// Response tokens of rows `rows`, one count per row (the `tokens_per_sample` of an actor loss).
    pub fn tokens_per_row(&self, rows: &[usize]) -> Vec<i64> {
        rows.iter()
            .map(|&i| self.rows[i].response.len() as i64)
            .collect()
    }

    /// Tokens of row `i` as a forward holds it: its prompt and its response.
    pub fn row_tokens(&self, i: usize) -> usize {
        self.rows[i].prompt.len() + self.rows[i].response.len()
    }

    /// `[rows, width]` zeros of `kind` on `device`.
    pub fn zeros(&self, kind: Kind, device: Device) -> Tensor {
        Tensor::zeros([self.len() as i64, self.response_width()], (kind, device))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn batch() -> RlBatch {
        let row = |prompt: Vec<i64>, response: Vec<i64>, uid| RlRow {
            prompt,
            response,
            uid,
            ..RlRow::default()
        };
        RlBatch::new(vec![
            row(vec![1, 2], vec![5, 6, 7], 0),
            row(vec![3], vec![8], 0),
            row(vec![4, 4, 4], vec![], 1),
        ])
    }

    #[test]
    fn micro_batch_targets_are_the_response_tokens_in_matrix_order() {
        let b = batch();
        assert_eq!(b.response_width(), 3);
        let mb = b
            .micro_batch(&[0, 1, 2], Layout::Padded, Device::Cpu)
            .unwrap();
        assert_eq!(mb.num_targets, 4);
        assert_eq!(Vec::<i64>::try_from(&mb.target_ids).unwrap(), [5, 6, 7, 8]);
        let mut m = b.zeros(Kind::Float, Device::Cpu);
        let tokens = b.gather_tokens(&Tensor::from_slice(&[1f32; 9]).view([3, 3]), &[0, 1, 2]);
        assert_eq!(tokens.size(), [4]);
        b.scatter_tokens(&mut m, &[1, 0], &Tensor::from_slice(&[8f32, 5., 6., 7.]));
        let back = b.gather_tokens(&m, &[0, 1]);
        assert_eq!(Vec::<f32>::try_from(&back).unwrap(), [5., 6., 7., 8.]);
        assert_eq!(m.sum(Kind::Float).double_value(&[]), 26.0);
    }

    #[test]
    fn rewards_sit_on_the_last_response_token() {
        let mut b = batch();
        assert!(b.token_level_rewards(Device::Cpu).is_err());
        b.rewards = Some(vec![1.0, 0.5, 2.0]);
        let r = b.token_level_rewards(Device::Cpu).unwrap();
        let v = Vec::<f32>::try_from(r.view([-1])).unwrap();
        assert_eq!(v, [0., 0., 1., 0.5, 0., 0., 0., 0., 0.]);
    }
}
