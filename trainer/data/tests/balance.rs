//! The token-budget partitioner (`ferl_data::balance`): its invariants, by example and by property.

use ferl_data::balance::{balance_ranks, greedy_partition, karmarkar_karp, max_load};
use ferl_data::Batching;
use proptest::prelude::*;

fn budget(max_tokens: usize, padded: bool) -> Batching {
    Batching::TokenBudget { max_tokens, padded }
}

fn cost(part: &[usize], lengths: &[usize], padded: bool) -> usize {
    let lens = part.iter().map(|&i| lengths[i]);
    if padded {
        part.len() * lens.max().unwrap()
    } else {
        lens.sum()
    }
}

/// Checks invariants 1-3 of a plan of `lengths` over `world` ranks; returns the micro-batch count.
fn check_plan(
    plan: &[Vec<Vec<usize>>],
    lengths: &[usize],
    world: usize,
    max: usize,
    padded: bool,
) -> usize {
    assert_eq!(plan.len(), world, "one entry per rank");
    let mut seen: Vec<usize> = plan.iter().flatten().flatten().copied().collect();
    seen.sort_unstable();
    assert_eq!(
        seen,
        (0..lengths.len()).collect::<Vec<_>>(),
        "invariant 1: complete and disjoint"
    );
    let count = plan[0].len();
    for (r, rank) in plan.iter().enumerate() {
        assert_eq!(
            rank.len(),
            count,
            "invariant 2: rank {r} has another micro-batch count"
        );
        for m in rank {
            assert!(
                !m.is_empty(),
                "invariant 2: an empty micro-batch on rank {r}"
            );
            let c = cost(m, lengths, padded);
            assert!(
                c <= max,
                "invariant 3: rank {r} micro-batch {m:?} costs {c} > {max}"
            );
        }
    }
    count
}

#[test]
fn invariant_1_to_3_on_gsm8k_like_lengths() {
    let lengths: Vec<usize> = (0..32).map(|i| 90 + (i * 37) % 160).collect();
    let rows: Vec<usize> = (100..132).collect();
    for padded in [false, true] {
        let plan = budget(600, padded).plan(&rows, &lengths, 2).unwrap();
        let count = check_plan(&plan, &lengths, 2, 600, padded);
        let total: usize = lengths.iter().sum();
        assert!(
            count >= total.div_ceil(2 * 600),
            "fewer micro-batches than the budget allows"
        );
    }
}

#[test]
fn fewest_micro_batches_when_everything_fits_one() {
    let lengths = [10, 20, 30, 40];
    let plan = budget(1000, false)
        .plan(&[0, 1, 2, 3], &lengths, 2)
        .unwrap();
    assert_eq!(plan.iter().map(Vec::len).collect::<Vec<_>>(), [1, 1]);
    assert_eq!(
        max_load(&plan.concat(), &lengths),
        50,
        "{plan:?}: 40+10 | 30+20"
    );
}

#[test]
fn ranks_agree_on_the_count_when_one_needs_more() {
    // Rank loads are balanced, but the long samples need a micro-batch each under the budget.
    let lengths = [100, 100, 100, 100, 5, 5, 5, 5];
    let plan = budget(120, false)
        .plan(&(0..8).collect::<Vec<_>>(), &lengths, 2)
        .unwrap();
    let count = check_plan(&plan, &lengths, 2, 120, false);
    assert_eq!(count, 2, "{plan:?}");
}

#[test]
fn padded_cost_is_rows_times_longest() {
    // Packed, 50+50+10+10 fits 120; padded, 4 rows × 50 does not.
    let lengths = [50, 50, 10, 10];
    let packed = budget(120, false).plan(&[0, 1, 2, 3], &lengths, 1).unwrap();
    assert_eq!(packed[0].len(), 1);
    let padded = budget(120, true).plan(&[0, 1, 2, 3], &lengths, 1).unwrap();
    check_plan(&padded, &lengths, 1, 120, true);
    assert_eq!(padded[0].len(), 2, "{padded:?}");
}

#[test]
fn a_sample_over_the_budget_is_refused_naming_its_row() {
    let err = budget(64, false)
        .plan(&[7, 41, 9, 3], &[10, 65, 10, 10], 2)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("training row 41 has 65 tokens")
            && err.contains("data.max_token_len_per_gpu=64"),
        "{err}"
    );
}

#[test]
fn fixed_micro_batches_are_contiguous_shards() {
    let plan = Batching::Fixed {
        micro_batch_size: 2,
    }
    .plan(&[5, 6, 7, 8, 9, 10], &[1; 6], 2)
    .unwrap();
    assert_eq!(
        plan,
        vec![vec![vec![0, 1], vec![2]], vec![vec![3, 4], vec![5]]]
    );
}

#[test]
fn karmarkar_karp_beats_greedy_on_its_classic_case() {
    // Two parts of {8,7,6,5,4}: greedy longest-first ends 17|13, largest differencing 16|14.
    let lengths = [8, 7, 6, 5, 4];
    let items: Vec<usize> = (0..5).collect();
    let kk = karmarkar_karp(&items, &lengths, 2, false);
    let greedy = greedy_partition(&items, &lengths, 2, None);
    assert_eq!(max_load(&greedy, &lengths), 17, "{greedy:?}");
    assert_eq!(max_load(&kk, &lengths), 16, "{kk:?}");
    let equal = karmarkar_karp(&(0..4).collect::<Vec<_>>(), &[10, 9, 2, 1], 2, true);
    assert!(equal.iter().all(|p| p.len() == 2), "{equal:?}");
    assert_eq!(max_load(&equal, &[10, 9, 2, 1]), 11);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn plans_keep_invariants_1_to_4(
        per_rank in 1usize..12,
        world in 1usize..5,
        seed_lengths in proptest::collection::vec(1usize..300, 48),
        slack in 0usize..900,
        padded in any::<bool>(),
    ) {
        let n = per_rank * world;
        let lengths = &seed_lengths[..n];
        let max = 300 + slack;
        let rows: Vec<usize> = (0..n).collect();
        let plan = budget(max, padded).plan(&rows, lengths, world).unwrap();
        check_plan(&plan, lengths, world, max, padded);
        let ranks: Vec<Vec<usize>> = plan.iter().map(|r| r.concat()).collect();
        prop_assert!(ranks.iter().all(|r| r.len() == per_rank), "equal samples per rank");
        let greedy = greedy_partition(&rows, lengths, world, Some(per_rank));
        prop_assert!(
            max_load(&ranks, lengths) <= max_load(&greedy, lengths),
            "invariant 4: heaviest rank {} > greedy's {}",
            max_load(&ranks, lengths),
            max_load(&greedy, lengths)
        );
        prop_assert_eq!(max_load(&ranks, lengths), max_load(&balance_ranks(lengths, world), lengths));
    }
}
