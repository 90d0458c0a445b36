//! Ulysses attention over a sequence-parallel group (`model::ulysses`), ranks as threads of one TCP group: each
//! rank's slice of the output and of the q/k/v gradients equals the same slice of plain single-process attention
//! over the whole sequence (forward and autograd backward) within 1e-5 — causal rows and packed sequences, GQA with
//! more KV heads than ranks and with fewer (repeated), at group sizes 2, 3 and 4. The exchanges are each other's
//! inverse, and heads that do not split over the group are refused naming both numbers. The head's rows dealt out
//! over the group (`head_share`, uneven counts, ranks without rows, fewer rows than ranks) give each rank the loss,
//! row gradients and statistics of its own rows, and the group's output-matrix gradient, within 1e-5.

#[path = "common/heads.rs"]
mod heads;

use ferl_trainer::model::layers::{self, Attention};
use ferl_trainer::model::ulysses::{SpAttention, SpGroup};
use ferl_trainer::model::varlen::Varlen;
use heads::{head_rows, with_comm, WeightedWithEntropy, CPU};
use std::sync::Arc;
use tch::{Device, Kind, Tensor};

const TOL: f64 = 1e-5;

/// Runs `body(group)` on `world` threads, each a rank of one TCP group; results in rank order.
fn with_group<T: Send + 'static>(
    world: usize,
    body: impl Fn(SpGroup) -> T + Send + Sync + 'static,
) -> Vec<T> {
    with_comm(world, move |comm| body(SpGroup::new(comm)))
}

struct Case {
    batch: i64,
    heads: i64,
    kv_heads: i64,
    tokens: i64,
    /// Packed sequence lengths (one row) instead of causal rows.
    packed: Option<Vec<i64>>,
}

fn attention(case: &Case) -> Attention {
    match &case.packed {
        Some(lens) => Attention::Varlen(Varlen::new(lens, Device::Cpu).unwrap()),
        None => Attention::Causal,
    }
}

/// Inputs (seeded), output gradient, and the reference output and q/k/v gradients.
fn reference(case: &Case) -> [Tensor; 8] {
    let d = 8;
    let (q, k, v, dy) = ferl_trainer::model::weights::seeded(case.tokens + case.kv_heads, || {
        (
            Tensor::randn([case.batch, case.heads, case.tokens, d], CPU),
            Tensor::randn([case.batch, case.kv_heads, case.tokens, d], CPU),
            Tensor::randn([case.batch, case.kv_heads, case.tokens, d], CPU),
            Tensor::randn([case.batch, case.heads, case.tokens, d], CPU),
        )
    });
    let leaves: Vec<Tensor> = [&q, &k, &v]
        .iter()
        .map(|t| t.detach().set_requires_grad(true))
        .collect();
    let gqa = case.heads != case.kv_heads;
    let y = layers::attend(&leaves[0], &leaves[1], &leaves[2], &attention(case), gqa);
    let g = Tensor::run_backward(
        &[(&y * &dy).sum(Kind::Float)],
        &[&leaves[0], &leaves[1], &leaves[2]],
        false,
        false,
    );
    let [gq, gk, gv]: [Tensor; 3] = g.try_into().unwrap();
    [q, k, v, dy, y.detach(), gq, gk, gv]
}

fn check(case: Case, world: usize) {
    let case = Arc::new(case);
    let results = with_group(world, move |group| {
        // Every rank computes the same seeded reference (one at a time: the seed is global).
        let e = reference(&case);
        let slice = |t: &Tensor| group.local_slice(t, 2).unwrap();
        let (q, k, v, dy) = (slice(&e[0]), slice(&e[1]), slice(&e[2]), slice(&e[3]));
        let (y, saved) = SpAttention::forward(&group, &q, &k, &v, &attention(&case)).unwrap();
        let (dq, dk, dv) = saved.backward(&group, &dy).unwrap();
        let diff = |a: &Tensor, b: &Tensor| (a - slice(b)).abs().max().double_value(&[]);
        [
            diff(&y, &e[4]),
            diff(&dq, &e[5]),
            diff(&dk, &e[6]),
            diff(&dv, &e[7]),
        ]
    });
    for (rank, diffs) in results.iter().enumerate() {
        for (what, d) in ["output", "dq", "dk", "dv"].iter().zip(diffs) {
            assert!(*d < TOL, "world {world} rank {rank}: {what} differs by {d}");
        }
    }
}

#[test]
fn causal_rows_match_whole_sequence_attention() {
    check(
        Case {
            batch: 2,
            heads: 4,
            kv_heads: 2,
            tokens: 12,
            packed: None,
        },
        2,
    );
    check(
        Case {
            batch: 1,
            heads: 4,
            kv_heads: 4,
            tokens: 12,
            packed: None,
        },
        4,
    );
}

#[test]
fn fewer_kv_heads_than_ranks_are_repeated() {
    check(
        Case {
            batch: 2,
            heads: 4,
            kv_heads: 2,
            tokens: 8,
            packed: None,
        },
        4,
    );
    check(
        Case {
            batch: 1,
            heads: 6,
            kv_heads: 1,
            tokens: 9,
            packed: None,
        },
        3,
    );
}

#[test]
fn packed_sequences_match_across_slices() {
    // Sequences cross the slice boundaries.
    let packed = Some(vec![5, 4, 7]);
    check(
        Case {
            batch: 1,
            heads: 4,
            kv_heads: 2,
            tokens: 16,
            packed: packed.clone(),
        },
        2,
    );
    check(
        Case {
            batch: 1,
            heads: 4,
            kv_heads: 2,
            tokens: 16,
            packed,
        },
        4,
    );
}

#[test]
fn exchanges_are_inverse_and_heads_must_split() {
    let ok = with_group(3, |group| {
        let x = Tensor::randn([2, 6, 5, 4], CPU) + group.rank() as f64;
        let there = group.seq_to_heads(&x).unwrap();
        let back = group.heads_to_seq(&there).unwrap();
        let refused = group.check_heads(4, 2).unwrap_err().to_string();
        (
            there.size(),
            back.equal(&x),
            refused,
            group.check_heads(6, 1).is_ok(),
        )
    });
    for (shape, inverse, refused, fine) in ok {
        assert_eq!(shape, [2, 2, 15, 4]);
        assert!(inverse && fine);
        assert!(
            refused.contains("=3") && refused.contains("=4"),
            "{refused}"
        );
    }
}

/// A tiny Qwen2-shaped engine on the CPU (4 heads, 2 KV heads), the same weights on every rank.
fn engine() -> ferl_trainer::engine::Engine<ferl_trainer::params::LocalParams> {
    use ferl_trainer::model::{config::ModelConfig, layout::ModelLayout, weights::init_params};
    let raw = serde_json::json!({
        "model_type": "qwen2", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 48, "vocab_size": 61,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": true
    });
    let cfg = ModelConfig::from_value(raw, std::path::Path::new("tiny.json")).unwrap();
    let layout = ModelLayout::new(&cfg);
    let params = init_params(&cfg, &layout, 9);
    let store = ferl_trainer::params::LocalParams::new(layout, params, Kind::Float);
    ferl_trainer::engine::Engine::new(cfg, store, Kind::Float, Default::default())
}

/// Summed loss and parameter gradients of one micro-batch of three samples (lengths 9, 5, 12), split over `sp`
/// (when given) or whole.
fn engine_step(
    layout: ferl_trainer::batch::Layout,
    checkpointing: bool,
    sp: Option<&SpGroup>,
) -> (f64, Vec<Vec<f32>>) {
    use ferl_trainer::batch::{MicroBatch, SampleRef};
    use ferl_trainer::params::ParamStore;
    let samples: Vec<(Vec<i64>, Vec<bool>)> = [(9usize, 4usize), (5, 2), (12, 7)]
        .iter()
        .enumerate()
        .map(|(s, &(len, prompt))| {
            (
                (0..len)
                    .map(|i| ((i * 7 + s * 13 + 3) % 61) as i64)
                    .collect(),
                (0..len).map(|i| i >= prompt).collect(),
            )
        })
        .collect();
    let refs: Vec<SampleRef> = samples
        .iter()
        .map(|(i, m)| SampleRef {
            input_ids: i,
            loss_mask: m,
        })
        .collect();
    let mut mb = MicroBatch::new(&refs, layout, Device::Cpu).unwrap();
    if let Some(group) = sp {
        let whole_targets = mb.num_targets;
        mb = mb.sequence_parallel(group).unwrap();
        // Every rank knows every rank's target count (the head deals the rows out by them).
        let counts = &mb.attention.sequence_parallel().unwrap().targets_per_rank;
        assert_eq!(counts.iter().sum::<i64>(), whole_targets, "{counts:?}");
        assert_eq!(counts[group.rank() as usize], mb.num_targets, "{counts:?}");
    }
    let mut e = engine();
    e.options_mut().gradient_checkpointing = checkpointing;
    e.store_mut().zero_grads();
    let loss = e.forward_backward(&mb, 17).unwrap();
    let (_, grads) = e.store_mut().master_and_grads();
    (
        loss,
        grads
            .iter()
            .map(|g| Vec::<f32>::try_from(g.flatten(0, -1)).unwrap())
            .collect(),
    )
}

#[test]
fn an_engine_step_over_the_group_sums_to_the_whole_sequence_step() {
    use ferl_trainer::batch::Layout;
    for layout in [Layout::Padded, Layout::Packed] {
        for checkpointing in [false, true] {
            let (loss, grads) = engine_step(layout, checkpointing, None);
            for world in [2usize, 4] {
                let ranks =
                    with_group(world, move |g| engine_step(layout, checkpointing, Some(&g)));
                let total: f64 = ranks.iter().map(|(l, _)| l).sum();
                let ctx = format!("{layout:?}, checkpointing {checkpointing}, SP {world}");
                assert!(
                    (total - loss).abs() < 1e-5 * loss.abs(),
                    "{ctx}: loss {total} vs {loss}"
                );
                let mut worst = 0f64;
                for (p, whole) in grads.iter().enumerate() {
                    for (i, w) in whole.iter().enumerate() {
                        let sum: f32 = ranks.iter().map(|(_, g)| g[p][i]).sum();
                        worst = worst.max(((sum - w).abs() - 1e-5 * w.abs()) as f64);
                    }
                }
                assert!(worst < 1e-5, "{ctx}: gradients differ by {worst}");
            }
        }
    }
}

/// The losses of the share test.
#[derive(Clone, Copy, Debug, PartialEq)]
enum ShareLoss {
    CrossEntropy,
    /// Cross-entropy through a head kernel ([`ChunkedKernel`]).
    KernelCrossEntropy,
    /// [`WeightedWithEntropy`].
    PerRow,
}

/// A head kernel made of the built-in chunked head (the share's kernel path).
struct ChunkedKernel;

impl ferl_trainer::kernels::HeadLoss for ChunkedKernel {
    fn sum_loss_and_grads(
        &self,
        x: &Tensor,
        w: &Tensor,
        targets: &Tensor,
    ) -> anyhow::Result<(Tensor, Tensor, Tensor)> {
        let mut head = ferl_trainer::head::ChunkedHead::new(3 * 50);
        let (ce, gx, gw) = head.loss_and_grads(x, w, targets, 1.0, true);
        Ok((ce, gx, gw.unwrap()))
    }
}

/// One rank of the share test: the reference (its own rows through a head of its own: value, row gradients, output
/// gradient), the shared head's, and the rows of its share; the statistics without gradients are checked here.
type ShareRank = (f64, Tensor, Tensor, (f64, Tensor, Tensor), i64);

fn share_rank(g: &SpGroup, counts: &[i64], which: ShareLoss) -> ShareRank {
    use ferl_trainer::head::{ChunkedHead, TokenGrad};
    use ferl_trainer::head_share::{head_loss, HeadShare};
    use ferl_trainer::loss::{CrossEntropy, TokenLoss};
    let (x, t, weights, w) = head_rows(counts, g.rank() as usize);
    let loss: Box<dyn TokenLoss> = match which {
        ShareLoss::PerRow => Box::new(WeightedWithEntropy { weights }),
        _ => Box::new(CrossEntropy::token_mean(13)),
    };
    let mut head = ChunkedHead::new(3 * 50); // chunks of 3 rows
    let grad = match loss.uniform_grad() {
        Some(c) => TokenGrad::Uniform(c),
        None => {
            loss.evaluate(&head.token_stats(&x, &w, &t, true))
                .unwrap()
                .grad
        }
    };
    let (stats, gx, gw) = head.backward(&x, &w, &t, &grad, true);
    let value = loss.evaluate(&stats).unwrap().value;
    let share = HeadShare::new(g, counts, Device::Cpu).unwrap();
    let mut head = ChunkedHead::new(3 * 50);
    let kernel = (which == ShareLoss::KernelCrossEntropy)
        .then_some(&ChunkedKernel as &dyn ferl_trainer::kernels::HeadLoss);
    let shared = head_loss(&share, &mut head, kernel, &x, &w, &t, loss.as_ref()).unwrap();
    // Without gradients (validation): the same statistics as this rank's own head.
    let own = head.token_stats(&x, &w, &t, true);
    let got = share.token_stats(&mut head, &x, &w, &t, true).unwrap();
    let diff = |a: &Tensor, b: &Tensor| (a - b).abs().sum(Kind::Double).double_value(&[]);
    let stats_diff =
        diff(&got.log_prob, &own.log_prob) + diff(&got.entropy.unwrap(), &own.entropy.unwrap());
    assert!(
        stats_diff < 1e-5,
        "rank {}: statistics differ by {stats_diff}",
        g.rank()
    );
    (value, gx, gw.unwrap(), shared, share.share_rows())
}

/// Each rank's row gradients against its reference, values per rank (or, through a kernel, which gives the share's
/// value, summed over the group), and the group's output-matrix gradient.
fn check_share_ranks(ctx: &str, counts: &[i64], ranks: &[ShareRank], per_rank_values: bool) {
    let (mut gw_ref, mut gw_shared) = (ranks[0].2.zeros_like(), ranks[0].2.zeros_like());
    let (mut own_sum, mut shared_sum) = (0.0, 0.0);
    for (r, (value, gx, gw, (v, sgx, sgw), _)) in ranks.iter().enumerate() {
        let own = if counts[r] > 0 { *value } else { 0.0 };
        own_sum += own;
        shared_sum += v;
        assert!(
            !per_rank_values || (v - own).abs() <= 1e-5 * own.abs().max(1.0),
            "{ctx}, rank {r}: value {v} vs {own}"
        );
        assert_eq!(sgx.size(), gx.size(), "{ctx}, rank {r}");
        if counts[r] > 0 {
            let diff = (sgx - gx).abs().max().double_value(&[]);
            assert!(
                diff < 1e-5,
                "{ctx}, rank {r}: row gradients differ by {diff}"
            );
        }
        gw_ref += gw;
        gw_shared += sgw;
    }
    let rel = (shared_sum - own_sum).abs() / own_sum.abs().max(1.0);
    assert!(
        rel < 1e-5,
        "{ctx}: the group's value {shared_sum} vs {own_sum}"
    );
    let diff = (&gw_shared - &gw_ref).abs().max().double_value(&[]);
    assert!(
        diff < 1e-5,
        "{ctx}: the group's output gradients differ by {diff}"
    );
}

#[test]
fn a_shared_head_gives_each_rank_the_loss_and_gradients_of_its_own_rows() {
    for counts in [
        vec![0i64, 7, 2],
        vec![5, 0],
        vec![3, 3, 3, 1],
        vec![0, 1, 0],
    ] {
        for which in [
            ShareLoss::CrossEntropy,
            ShareLoss::KernelCrossEntropy,
            ShareLoss::PerRow,
        ] {
            let counts_here = counts.clone();
            let ranks = with_group(counts.len(), move |g| share_rank(&g, &counts_here, which));
            let ctx = format!("counts {counts:?}, {which:?}");
            let total: i64 = counts.iter().sum();
            let shares: Vec<i64> = ranks.iter().map(|r| r.4).collect();
            assert_eq!(
                shares.iter().sum::<i64>(),
                total,
                "{ctx}: shares {shares:?}"
            );
            assert!(
                shares
                    .iter()
                    .all(|&s| (s - total / counts.len() as i64).abs() <= 1),
                "{ctx}: {shares:?}"
            );
            check_share_ranks(
                &ctx,
                &counts,
                &ranks,
                which != ShareLoss::KernelCrossEntropy,
            );
        }
    }
}
