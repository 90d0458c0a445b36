//! Helpers of the tests of heads computed over a group of ranks (`ulysses.rs`'s shared head, `vocab_parallel.rs`'s
//! split head): ranks as threads of one TCP group, the rows each rank holds, and a per-row loss with an entropy term.

#![allow(dead_code)]

use ferl_collective::{Communicator, GroupOptions, MemoryRendezvous, Rendezvous, TcpCommunicator};
use ferl_trainer::head::{TokenGrad, TokenStats};
use ferl_trainer::loss::{TokenLoss, TokenLossValue};
use std::sync::Arc;
use std::time::Duration;
use tch::{Device, Kind, Tensor};

/// fp32 on the CPU.
pub(crate) const CPU: (Kind, Device) = (Kind::Float, Device::Cpu);

/// Runs `body(communicator)` on `world` threads, each a rank of one TCP group; results in rank order.
pub(crate) fn with_comm<T: Send + 'static>(
    world: usize,
    body: impl Fn(Arc<dyn Communicator>) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let store: Arc<dyn Rendezvous> = Arc::new(MemoryRendezvous::new());
    let body = Arc::new(body);
    let options = GroupOptions {
        timeout: Duration::from_secs(60),
        ..GroupOptions::default()
    };
    let threads: Vec<_> = (0..world)
        .map(|rank| {
            let (store, body, options) = (store.clone(), body.clone(), options.clone());
            std::thread::spawn(move || {
                tch::set_num_threads(1);
                let comm = TcpCommunicator::connect(rank, world, store, &options).unwrap();
                body(Arc::new(comm))
            })
        })
        .collect();
    threads.into_iter().map(|t| t.join().unwrap()).collect()
}

/// A per-row loss with an entropy term: `Σ wᵢ · (−log pᵢ) − 0.1 · Σ Hᵢ` over a rank's own rows.
pub(crate) struct WeightedWithEntropy {
    pub(crate) weights: Tensor,
}

impl TokenLoss for WeightedWithEntropy {
    fn needs_entropy(&self) -> bool {
        true
    }

    fn evaluate(&self, stats: &TokenStats) -> anyhow::Result<TokenLossValue> {
        let entropy = stats.entropy.as_ref().expect("entropy asked for");
        let value = (-(&stats.log_prob * &self.weights).sum(Kind::Double)
            - entropy.sum(Kind::Double) * 0.1)
            .double_value(&[]);
        Ok(TokenLossValue {
            value,
            grad: TokenGrad::PerRow {
                log_prob: -&self.weights,
                entropy: Some(entropy.full_like(-0.1)),
            },
        })
    }
}

/// Rank `rank`'s rows: `counts[rank]` rows of width 8, their targets among 50 words, loss weights; and the output
/// matrix `[50, 8]`, the same on every rank.
pub(crate) fn head_rows(counts: &[i64], rank: usize) -> (Tensor, Tensor, Tensor, Tensor) {
    use ferl_trainer::model::weights::seeded;
    let w = seeded(99, || Tensor::randn([50, 8], CPU).set_requires_grad(true));
    let n = counts[rank];
    let (x, t, weights) = seeded(rank as i64 + 7, || {
        let x = Tensor::randn([n, 8], CPU);
        let t = Tensor::randint(50, [n], (Kind::Int64, Device::Cpu));
        (x, t, Tensor::rand([n], CPU))
    });
    (x, t, weights, w)
}
