//! Pluggable losses through the engine (design decision 13): a loss given as a function of the target rows'
//! log-probabilities and entropies ([`ferl_trainer::loss::TokenLoss`]) back-propagates through the same layer-wise
//! engine as SFT's cross-entropy.
//! - Cross-entropy written as an autograd loss (the two-pass path) gives the one-pass path's loss and every parameter
//!   gradient within 1e-6 (padded and packed, with and without gradient checkpointing).
//! - `Engine::token_stats` equals the log-softmax of the engine's full logits at the targets, and their entropy,
//!   within 1e-5.
//! - A loss with an entropy term changes the gradients by exactly that term's share: the gradient of
//!   `CE + c·Σ entropy` minus the gradient of `CE` is `c` times the gradient of `Σ entropy` (linearity, 1e-6).

use anyhow::Context;
use ferl_trainer::batch::{Layout, MicroBatch, SampleRef};
use ferl_trainer::engine::{Engine, EngineOptions};
use ferl_trainer::loss::{AutogradTokenLoss, CrossEntropy, TokenLoss};
use ferl_trainer::model::config::ModelConfig;
use ferl_trainer::model::layout::ModelLayout;
use ferl_trainer::model::weights::init_params;
use ferl_trainer::params::{LocalParams, ParamStore};
use tch::{Device, Kind, Tensor};

fn engine(checkpointing: bool) -> Engine<LocalParams> {
    let raw = serde_json::json!({
        "model_type": "qwen2", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 48, "vocab_size": 97,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": true
    });
    let cfg = ModelConfig::from_value(raw, std::path::Path::new("tiny.json")).unwrap();
    let layout = ModelLayout::new(&cfg);
    let params = init_params(&cfg, &layout, 5);
    let store = LocalParams::new(layout, params, Kind::Float);
    let opts = EngineOptions {
        gradient_checkpointing: checkpointing,
        logits_chunk_elements: 3 * 97, // several chunks per micro-batch
        ..Default::default()
    };
    Engine::new(cfg, store, Kind::Float, opts)
}

/// Three samples of different lengths with prompt (no loss) and response (loss) tokens.
fn samples() -> Vec<(Vec<i64>, Vec<bool>)> {
    [(9usize, 4usize), (5, 2), (12, 7)]
        .iter()
        .enumerate()
        .map(|(s, &(len, prompt))| {
            let ids = (0..len)
                .map(|i| ((i * 7 + s * 13 + 3) % 97) as i64)
                .collect();
            let mask = (0..len).map(|i| i >= prompt).collect();
            (ids, mask)
        })
        .collect()
}

fn micro_batch(layout: Layout) -> MicroBatch {
    let owned = samples();
    let refs: Vec<SampleRef> = owned
        .iter()
        .map(|(ids, mask)| SampleRef {
            input_ids: ids,
            loss_mask: mask,
        })
        .collect();
    MicroBatch::new(&refs, layout, Device::Cpu).unwrap()
}

/// The loss's reported value and every parameter's gradient.
fn run(
    engine: &mut Engine<LocalParams>,
    mb: &MicroBatch,
    loss: &dyn TokenLoss,
) -> (f64, Vec<Tensor>) {
    engine.store_mut().zero_grads();
    let value = engine.forward_backward_with(mb, loss).unwrap();
    let (_, grads) = engine.store_mut().master_and_grads();
    (value, grads.iter().map(|g| g.copy()).collect())
}

fn max_diff(a: &[Tensor], b: &[Tensor]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs().max().double_value(&[]))
        .fold(0.0, f64::max)
}

#[test]
fn cross_entropy_as_an_autograd_loss_equals_the_one_pass_path() {
    for layout in [Layout::Padded, Layout::Packed] {
        for checkpointing in [false, true] {
            let mut e = engine(checkpointing);
            let mb = micro_batch(layout);
            let scale = 1.0 / 40.0;
            let (ce, ce_grads) = run(&mut e, &mb, &CrossEntropy { scale });
            let two_pass = AutogradTokenLoss::new(
                |lp: &Tensor, _: Option<&Tensor>| Ok(-lp.sum(Kind::Double) * scale),
                false,
            );
            let (value, grads) = run(&mut e, &mb, &two_pass);
            let ctx = format!("{layout:?}, checkpointing {checkpointing}");
            assert!(
                (value - ce * scale).abs() < 1e-9,
                "{ctx}: {value} vs {}",
                ce * scale
            );
            let diff = max_diff(&grads, &ce_grads);
            assert!(diff < 1e-6, "{ctx}: gradients differ by {diff}");
            assert!(ce_grads
                .iter()
                .any(|g| g.abs().max().double_value(&[]) > 0.0));
        }
    }
}

#[test]
fn token_stats_are_the_log_softmax_and_entropy_of_the_logits_at_the_targets() {
    let mut e = engine(false);
    let mb = micro_batch(Layout::Padded);
    let stats = e.token_stats(&mb, true).unwrap();
    let logits = e.logits(&mb).unwrap();
    let rows = logits
        .reshape([-1, 97])
        .index_select(0, &mb.target_rows)
        .log_softmax(1, Kind::Float);
    let lp = rows
        .gather(1, &mb.target_ids.unsqueeze(1), false)
        .squeeze_dim(1);
    let h = -(rows.exp() * &rows).sum_dim_intlist(1, false, Kind::Float);
    assert_eq!(stats.log_prob.size(), [mb.num_targets]);
    let d_lp = (&stats.log_prob - lp).abs().max().double_value(&[]);
    let d_h = (stats.entropy.unwrap() - h).abs().max().double_value(&[]);
    assert!(
        d_lp < 1e-5 && d_h < 1e-5,
        "log-probs off by {d_lp}, entropy by {d_h}"
    );
    let (ce, n) = e.eval_loss(&mb).unwrap();
    assert_eq!(n, mb.num_targets);
    assert!((ce + stats.log_prob.sum(Kind::Double).double_value(&[])).abs() < 1e-9);
}

#[test]
fn an_entropy_term_adds_exactly_its_own_gradient() {
    let mut e = engine(false);
    let mb = micro_batch(Layout::Packed);
    let c = 0.3;
    let entropy_sum = |h: Option<&Tensor>| -> anyhow::Result<Tensor> {
        Ok(h.context("entropy")?.sum(Kind::Double))
    };
    let ce = CrossEntropy { scale: 0.1 };
    let with_bonus = AutogradTokenLoss::new(
        |lp: &Tensor, h: Option<&Tensor>| Ok(-lp.sum(Kind::Double) * 0.1 + entropy_sum(h)? * c),
        true,
    );
    let entropy_only =
        AutogradTokenLoss::new(|_: &Tensor, h: Option<&Tensor>| entropy_sum(h), true);
    let (_, g_ce) = run(&mut e, &mb, &ce);
    let (_, g_both) = run(&mut e, &mb, &with_bonus);
    let (_, g_h) = run(&mut e, &mb, &entropy_only);
    let share: Vec<Tensor> = g_both.iter().zip(&g_ce).map(|(b, a)| b - a).collect();
    let scaled: Vec<Tensor> = g_h.iter().map(|g| g * c).collect();
    let diff = max_diff(&share, &scaled);
    assert!(diff < 1e-6, "the entropy term's share differs by {diff}");
    assert!(
        g_h.iter().any(|g| g.abs().max().double_value(&[]) > 1e-6),
        "entropy moves the weights"
    );
}
