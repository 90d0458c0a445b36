//! The head split by vocabulary rows (`vocab_parallel`), ranks as threads of one TCP group, against each rank's own
//! head over the whole matrix: each rank's loss value, the gradient of its rows and their statistics, and each rank's
//! rows of the group's output-matrix gradient, within 1e-5 — at 2, 3 and 4 ranks, with uneven row counts, ranks
//! without rows, uneven vocabulary slices and a rank holding none; for cross-entropy (one pass), a per-row loss with
//! an entropy term (two passes), a temperature, and a frozen matrix.

#[path = "common/heads.rs"]
mod heads;

use ferl_trainer::head::{ChunkedHead, TokenGrad};
use ferl_trainer::loss::{CrossEntropy, TokenLoss};
use ferl_trainer::vocab_parallel::{head_loss, token_stats, VocabSlice};
use heads::{head_rows, with_comm, WeightedWithEntropy};
use tch::Tensor;

const TOL: f64 = 1e-5;

/// Each rank's row count, and each rank's vocabulary slice `(first row, rows)`.
type Case = (Vec<i64>, Vec<(i64, i64)>);
/// Elements of a logits chunk: a few rows per chunk at these widths.
const CHUNK: i64 = 60;

/// The losses of the test.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Loss {
    CrossEntropy,
    PerRow,
    PerRowTempered,
    CrossEntropyFrozen,
    /// Cross-entropy, the matrix's gradient added into the slice's gradient rows.
    CrossEntropyInto,
}

impl Loss {
    fn temperature(self) -> f64 {
        if self == Loss::PerRowTempered {
            0.7
        } else {
            1.0
        }
    }

    fn of(self, weights: Tensor) -> Box<dyn TokenLoss> {
        match self {
            Loss::PerRow | Loss::PerRowTempered => Box::new(WeightedWithEntropy { weights }),
            _ => Box::new(CrossEntropy::token_mean(13)),
        }
    }
}

/// One rank's results, reference first: (value, row gradients, whole-matrix gradient of its rows), then the split
/// head's (value, row gradients, its slice's gradient).
type RankResult = ((f64, Tensor, Tensor), (f64, Tensor, Tensor));

fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    match a.numel() {
        0 => 0.0,
        _ => (a - b).abs().max().double_value(&[]),
    }
}

fn rank_result(
    comm: std::sync::Arc<dyn ferl_collective::Communicator>,
    counts: &[i64],
    slices: &[(i64, i64)],
    which: Loss,
) -> RankResult {
    let rank = comm.rank();
    let (x, t, weights, w) = head_rows(counts, rank);
    let loss = which.of(weights);
    let mut head = ChunkedHead::new(CHUNK);
    head.set_temperature(which.temperature()).unwrap();
    let grad = match loss.uniform_grad() {
        Some(c) => TokenGrad::Uniform(c),
        None => {
            let stats = head.token_stats(&x, &w, &t, true);
            loss.evaluate(&stats).unwrap().grad
        }
    };
    let (stats, gx, gw) = head.backward(&x, &w, &t, &grad, true);
    let value = loss.evaluate(&stats).unwrap().value;
    let (start, rows) = slices[rank];
    let slice = VocabSlice {
        start,
        weight: w.detach().narrow(0, start, rows),
        vocab: w.size()[0],
        trains: which != Loss::CrossEntropyFrozen,
        grad: (which == Loss::CrossEntropyInto).then(|| Tensor::zeros([rows, 8], heads::CPU)),
        group: comm,
    };
    let mut split = head_loss(&slice, &mut head, &x, &t, loss.as_ref()).unwrap();
    let returned = slice.trains && slice.grad.is_none();
    assert_eq!(
        split.2.defined(),
        returned,
        "{which:?}: the gradient is returned or added into"
    );
    if let Some(into) = &slice.grad {
        split.2 = into.shallow_clone();
    }
    // Without gradients (validation, scoring): this rank's own head's statistics.
    let own = head.token_stats(&x, &w, &t, true);
    let got = token_stats(&slice, &mut head, &x, &t, true).unwrap();
    let diff = max_diff(&got.log_prob, &own.log_prob)
        .max(max_diff(&got.entropy.unwrap(), &own.entropy.unwrap()));
    assert!(
        diff < TOL,
        "rank {rank}, {which:?}: statistics differ by {diff}"
    );
    ((value, gx, gw.unwrap()), split)
}

fn check(counts: &[i64], slices: &[(i64, i64)], which: Loss, ranks: &[RankResult]) {
    let ctx = format!("counts {counts:?}, slices {slices:?}, {which:?}");
    let whole_gw = ranks
        .iter()
        .map(|((_, _, gw), _)| gw.shallow_clone())
        .reduce(|a, b| a + b)
        .unwrap();
    for (r, ((value, gx, _), (v, sgx, sgw))) in ranks.iter().enumerate() {
        let own = if counts[r] > 0 { *value } else { 0.0 };
        assert!(
            (v - own).abs() <= TOL * own.abs().max(1.0),
            "{ctx}, rank {r}: value {v} vs {own}"
        );
        assert_eq!(sgx.size(), gx.size(), "{ctx}, rank {r}");
        if counts[r] > 0 {
            let diff = max_diff(sgx, gx);
            assert!(
                diff < TOL,
                "{ctx}, rank {r}: row gradients differ by {diff}"
            );
        }
        if which != Loss::CrossEntropyFrozen {
            let (start, rows) = slices[r];
            let diff = max_diff(sgw, &whole_gw.narrow(0, start, rows));
            assert!(
                diff < TOL,
                "{ctx}, rank {r}: its rows' gradient differs by {diff}"
            );
        }
    }
}

#[test]
fn a_split_head_gives_each_rank_its_rows_loss_and_gradients_and_its_slice_of_the_matrix_gradient() {
    let cases: [Case; 4] = [
        (vec![5, 3], vec![(0, 25), (25, 25)]),
        (vec![0, 7, 2], vec![(0, 20), (20, 15), (35, 15)]),
        (vec![3, 3, 3, 1], vec![(0, 20), (20, 0), (20, 20), (40, 10)]),
        (vec![0, 0], vec![(0, 25), (25, 25)]),
    ];
    for (counts, slices) in cases {
        for which in [
            Loss::CrossEntropy,
            Loss::PerRow,
            Loss::PerRowTempered,
            Loss::CrossEntropyFrozen,
            Loss::CrossEntropyInto,
        ] {
            let (c, s) = (counts.clone(), slices.clone());
            let ranks = with_comm(counts.len(), move |comm| rank_result(comm, &c, &s, which));
            check(&counts, &slices, which, &ranks);
        }
    }
}

/// One rank of the embedding test: its ids' rows through the split matrix against the whole matrix's, and (for the
/// caller to check) its slice's gradient with the whole matrix's gradient from its own ids.
fn embed_rank(
    comm: std::sync::Arc<dyn ferl_collective::Communicator>,
    counts: &[i64],
    slices: &[(i64, i64)],
) -> (Tensor, Tensor) {
    use ferl_trainer::model::weights::seeded;
    use ferl_trainer::vocab_parallel::{embed, embedding_grad};
    let rank = comm.rank();
    let (_, _, _, w) = head_rows(counts, rank);
    let n = counts[rank];
    let (ids, grad) = seeded(rank as i64 + 31, || {
        let ids = tch::Tensor::randint(50, [1, n], (tch::Kind::Int64, tch::Device::Cpu));
        (ids, Tensor::randn([1, n, 8], heads::CPU))
    });
    let (start, rows) = slices[rank];
    let slice = VocabSlice {
        start,
        weight: w.detach().narrow(0, start, rows),
        vocab: w.size()[0],
        trains: true,
        grad: None,
        group: comm,
    };
    let looked_up = embed(&slice, &ids).unwrap();
    let whole = w
        .detach()
        .index_select(0, &ids.reshape([-1]))
        .view([1, n, 8]);
    let diff = max_diff(&looked_up, &whole);
    assert!(diff == 0.0, "rank {rank}: looked-up rows differ by {diff}");
    let (index, row_grads) = embedding_grad(&slice, &ids, &grad)
        .unwrap()
        .expect("the matrix trains");
    let rows_grad = Tensor::zeros([rows, 8], heads::CPU).index_add(0, &index, &row_grads);
    let own_whole_grad =
        w.detach()
            .zeros_like()
            .index_add(0, &ids.reshape([-1]), &grad.view([n, 8]));
    (rows_grad, own_whole_grad)
}

#[test]
fn a_split_embedding_looks_up_every_rank_s_ids_and_sums_their_gradients_into_the_rows_that_hold_them(
) {
    let cases: [Case; 3] = [
        (vec![6, 9], vec![(0, 25), (25, 25)]),
        (vec![0, 7, 3], vec![(0, 20), (20, 15), (35, 15)]),
        (vec![4, 4, 4, 1], vec![(0, 20), (20, 0), (20, 20), (40, 10)]),
    ];
    for (counts, slices) in cases {
        let (c, s) = (counts.clone(), slices.clone());
        let ranks = with_comm(counts.len(), move |comm| embed_rank(comm, &c, &s));
        let whole = ranks
            .iter()
            .map(|(_, g)| g.shallow_clone())
            .reduce(|a, b| a + b)
            .unwrap();
        for (r, ((rows_grad, _), &(start, rows))) in ranks.iter().zip(&slices).enumerate() {
            let diff = max_diff(rows_grad, &whole.narrow(0, start, rows));
            assert!(
                diff < TOL,
                "{counts:?}, rank {r}: its rows' gradient differs by {diff}"
            );
        }
    }
}
