//! Pluggable losses (design decision 13): the engine computes per-token quantities of a micro-batch's target rows —
//! the log-probability of each target and, when asked, the entropy of each row's distribution ([`TokenStats`]) —
//! and a [`TokenLoss`] is a function of them. SFT's cross-entropy is one such loss; the PPO/GRPO actor losses of
//! [`crate::rl`] are others. The engine back-propagates the loss's per-token gradients through the log-softmax and
//! the output projection by hand ([`crate::head::ChunkedHead::backward`]), then through the layers as for SFT.
//!
//! A loss whose gradient is the same constant on every log-probability and nothing on the entropy (cross-entropy)
//! says so with [`TokenLoss::uniform_grad`] and costs one pass over the vocabulary; any other loss costs two (the
//! statistics first, then the gradients from its per-token gradients).

use crate::head::{TokenGrad, TokenStats};
use anyhow::{Context, Result};
use tch::{Kind, Tensor};

/// A loss over the target rows of one micro-batch, in the order of the micro-batch's `target_rows`.
pub trait TokenLoss {
    /// Whether [`TokenLoss::evaluate`] needs each row's entropy.
    fn needs_entropy(&self) -> bool {
        false
    }

    /// `Some(c)` when `d loss / d log p(target) = c` on every row and the loss has no entropy term: the engine then
    /// computes the statistics and the gradients in one pass and calls [`TokenLoss::evaluate`] after.
    fn uniform_grad(&self) -> Option<f64> {
        None
    }

    /// The loss's value for these rows and its gradients with respect to their log-probabilities (and entropies).
    fn evaluate(&self, stats: &TokenStats) -> Result<TokenLossValue>;
}

/// What a [`TokenLoss`] returns for one micro-batch.
pub struct TokenLossValue {
    /// The value the engine reports for the micro-batch (each loss documents what it is).
    pub value: f64,
    /// Its gradient with respect to each row's log-probability (and entropy).
    pub grad: TokenGrad,
}

/// SFT's loss: `scale · Σ -log p(target)`, with `scale = 1 / (targets of the global batch)` so that gradients do
/// not depend on how the batch is split. Its reported value is the micro-batch's *unscaled* summed cross-entropy.
#[derive(Clone, Copy, Debug)]
pub struct CrossEntropy {
    /// The factor of the gradient.
    pub scale: f64,
}

impl CrossEntropy {
    /// The token-mean cross-entropy of a global batch with `global_targets` targets.
    pub fn token_mean(global_targets: i64) -> Self {
        Self {
            scale: 1.0 / global_targets.max(1) as f64,
        }
    }
}

impl TokenLoss for CrossEntropy {
    fn uniform_grad(&self) -> Option<f64> {
        Some(-self.scale)
    }

    fn evaluate(&self, stats: &TokenStats) -> Result<TokenLossValue> {
        Ok(TokenLossValue {
            value: stats.cross_entropy_sum().double_value(&[]),
            grad: TokenGrad::Uniform(-self.scale),
        })
    }
}

/// A loss written as a tch function of the per-row log-probabilities (`[n]`) and, with `entropy`, entropies
/// (`[n]`), differentiated by autograd over those small vectors (the vocabulary-sized part is done by the head).
/// The function returns the 0-d loss to back-propagate; the reported value is that loss.
pub struct AutogradTokenLoss<F> {
    f: F,
    entropy: bool,
}

impl<F> AutogradTokenLoss<F>
where
    F: Fn(&Tensor, Option<&Tensor>) -> Result<Tensor>,
{
    /// The loss `f(log_prob, entropy)`; `entropy` says whether `f` needs the entropies.
    pub fn new(f: F, entropy: bool) -> Self {
        Self { f, entropy }
    }
}

impl<F> TokenLoss for AutogradTokenLoss<F>
where
    F: Fn(&Tensor, Option<&Tensor>) -> Result<Tensor>,
{
    fn needs_entropy(&self) -> bool {
        self.entropy
    }

    fn evaluate(&self, stats: &TokenStats) -> Result<TokenLossValue> {
        let leaf = |t: &Tensor| t.detach().to_kind(Kind::Float).set_requires_grad(true);
        let log_prob = leaf(&stats.log_prob);
        let entropy = match (self.entropy, &stats.entropy) {
            (true, Some(e)) => Some(leaf(e)),
            (true, None) => anyhow::bail!("the loss needs entropies and none were computed"),
            (false, _) => None,
        };
        let loss = tch::with_grad(|| (self.f)(&log_prob, entropy.as_ref()))?;
        let value = loss.double_value(&[]);
        let mut inputs = vec![&log_prob];
        inputs.extend(entropy.as_ref());
        let grads = match loss.requires_grad() {
            true => Tensor::f_run_backward(&[&loss], &inputs, false, false)?,
            false => vec![],
        };
        // An input the loss does not use gets an undefined gradient from autograd: zero.
        let mut grads = inputs.iter().enumerate().map(|(i, t)| match grads.get(i) {
            Some(g) if g.defined() => g.shallow_clone(),
            _ => t.zeros_like(),
        });
        let d_log_prob = grads.next().context("the log-prob gradient")?;
        Ok(TokenLossValue {
            value,
            grad: TokenGrad::PerRow {
                log_prob: d_log_prob,
                entropy: grads.next(),
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Device;

    fn stats() -> TokenStats {
        TokenStats {
            log_prob: Tensor::from_slice(&[-0.5f32, -1.0, -2.0]),
            entropy: Some(Tensor::from_slice(&[1.0f32, 0.5, 0.25])),
        }
    }

    fn per_row(grad: &TokenGrad) -> (Vec<f32>, Option<Vec<f32>>) {
        let TokenGrad::PerRow { log_prob, entropy } = grad else {
            panic!("expected per-row gradients")
        };
        let v = |t: &Tensor| Vec::<f32>::try_from(t).expect("f32 vector");
        (v(log_prob), entropy.as_ref().map(v))
    }

    #[test]
    fn cross_entropy_is_a_uniform_gradient_and_reports_the_unscaled_sum() {
        let ce = CrossEntropy::token_mean(4);
        assert_eq!(ce.uniform_grad(), Some(-0.25));
        let v = ce.evaluate(&stats()).unwrap();
        assert!((v.value - 3.5).abs() < 1e-12);
        assert!(matches!(v.grad, TokenGrad::Uniform(c) if c == -0.25));
    }

    #[test]
    fn autograd_losses_give_per_row_gradients_and_zero_for_unused_inputs() {
        let adv = Tensor::from_slice(&[1.0f32, -2.0, 3.0]);
        let with_entropy = AutogradTokenLoss::new(
            |lp: &Tensor, h: Option<&Tensor>| {
                let h = h.context("entropy")?;
                Ok((lp * &adv).sum(Kind::Float) - h.sum(Kind::Float) * 0.5)
            },
            true,
        );
        assert!(with_entropy.needs_entropy() && with_entropy.uniform_grad().is_none());
        let v = with_entropy.evaluate(&stats()).unwrap();
        assert!((v.value - (-0.5 + 2.0 - 6.0 - 0.875)).abs() < 1e-6);
        assert_eq!(
            per_row(&v.grad),
            (vec![1.0, -2.0, 3.0], Some(vec![-0.5; 3]))
        );
        let entropy_only = AutogradTokenLoss::new(
            |_: &Tensor, h: Option<&Tensor>| Ok(h.context("entropy")?.sum(Kind::Float)),
            true,
        );
        let v = entropy_only.evaluate(&stats()).unwrap();
        assert_eq!(per_row(&v.grad), (vec![0.0; 3], Some(vec![1.0; 3])));
        let missing = TokenStats {
            log_prob: Tensor::zeros([3], (Kind::Float, Device::Cpu)),
            entropy: None,
        };
        let err = entropy_only.evaluate(&missing).err().expect("no entropies");
        assert!(err.to_string().contains("entropies"), "{err}");
    }
}
