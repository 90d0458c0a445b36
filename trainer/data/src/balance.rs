//! How one global batch is cut into per-rank micro-batches: fixed micro-batches (`data.micro_batch_size_per_gpu`
//! samples each, contiguous rank shards), or token-budget micro-batches (`data.use_dynamic_bsz` with
//! `data.max_token_len_per_gpu`, verl's engine-trainer keys).
//!
//! Token-budget plan, in two stages:
//! 1. **Ranks.** The batch's samples are split over the data-parallel ranks by token count, each rank getting the
//!    same number of samples: the better (smaller heaviest rank) of Karmarkar–Karp's largest differencing and the
//!    greedy longest-first assignment.
//! 2. **Micro-batches.** Each rank finds the fewest micro-batches under the budget it can form (Karmarkar–Karp over
//!    a growing count, first-fit decreasing as the fallback); every rank then forms the largest of those counts, so
//!    the ranks' collectives line up, splitting its heaviest micro-batches where it needs more.
//!
//! Invariants (tests name them):
//! 1. A plan is complete and disjoint: every position of the batch appears in exactly one micro-batch of one rank.
//! 2. Every rank has the same number of micro-batches, none of them empty.
//! 3. Under a token budget every micro-batch costs at most the budget: its tokens when packed, its rows × its
//!    longest sample when padded (the positions the model computes on).
//! 4. The heaviest rank carries no more tokens than under the greedy longest-first assignment.
//!
//! The plan only moves samples: the loss stays the token-mean over the whole global batch (the engine divides by the
//! global target count), so it equals the fixed split's up to float summation order.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use anyhow::{bail, Result};
use ferl_config::SftConfig;

use crate::batch::rank_shard;

/// How a rank's share of a global batch is cut into micro-batches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Batching {
    /// Contiguous rank shards in micro-batches of this many samples (`data.micro_batch_size_per_gpu`).
    Fixed {
        /// Samples per micro-batch.
        micro_batch_size: usize,
    },
    /// Balanced micro-batches under a token budget (`data.use_dynamic_bsz=true`).
    TokenBudget {
        /// `data.max_token_len_per_gpu`.
        max_tokens: usize,
        /// Micro-batches are padded (`use_remove_padding=false`): a micro-batch costs rows × its longest sample.
        padded: bool,
    },
}

/// One rank's micro-batches, each a list of positions in the global batch (ascending).
pub type RankMicroBatches = Vec<Vec<usize>>;

impl Batching {
    /// The batching `cfg` asks for.
    pub fn from_config(cfg: &SftConfig) -> Self {
        let d = &cfg.data;
        if d.use_dynamic_bsz {
            Self::TokenBudget {
                max_tokens: d.max_token_len_per_gpu,
                padded: !cfg.use_remove_padding,
            }
        } else {
            Self::Fixed {
                micro_batch_size: d.micro_batch_size_per_gpu,
            }
        }
    }

    /// Splits a global batch (training-set rows `rows`, of `lengths` tokens) over `world` ranks: per rank, its
    /// micro-batches as positions into `rows`. A sample longer than the budget is refused, naming its row.
    pub fn plan(
        &self,
        rows: &[usize],
        lengths: &[usize],
        world: usize,
    ) -> Result<Vec<RankMicroBatches>> {
        if rows.len() != lengths.len() || world == 0 || rows.len() < world {
            bail!(
                "a global batch of {} samples ({} lengths) cannot be split over {world} ranks",
                rows.len(),
                lengths.len()
            );
        }
        match *self {
            Self::Fixed { micro_batch_size } => Ok(fixed_plan(rows.len(), world, micro_batch_size)),
            Self::TokenBudget { max_tokens, padded } => {
                let budget = Budget { max_tokens, padded };
                if !rows.len().is_multiple_of(world) {
                    bail!(
                        "data.use_dynamic_bsz: a global batch of {} samples does not split evenly over {world} ranks",
                        rows.len()
                    );
                }
                if let Some(i) = (0..lengths.len()).find(|&i| lengths[i] > max_tokens) {
                    bail!(
                        "training row {} has {} tokens, more than data.max_token_len_per_gpu={max_tokens}: one \
                         sample must fit a micro-batch (raise the budget or lower data.max_length with truncation)",
                        rows[i],
                        lengths[i]
                    );
                }
                Ok(budget_plan(lengths, world, budget))
            }
        }
    }
}

/// Cuts each rank's own items (`shares[r]`, indices into `lengths`) into micro-batches of at most `max_tokens`
/// tokens (`padded`: a micro-batch costs its rows × its longest), every rank into as many micro-batches (the most any
/// rank needs), so that ranks whose forwards meet in collectives run as many. Every rank must hold as many items;
/// an item longer than the budget is refused, naming its index.
pub fn budget_micro_batches(
    shares: &[Vec<usize>],
    lengths: &[usize],
    max_tokens: usize,
    padded: bool,
) -> Result<Vec<RankMicroBatches>> {
    if let Some(&i) = shares.iter().flatten().find(|&&i| lengths[i] > max_tokens) {
        bail!(
            "item {i} has {} tokens, more than a micro-batch's budget of {max_tokens}",
            lengths[i]
        );
    }
    if shares.windows(2).any(|w| w[0].len() != w[1].len()) {
        bail!("every rank must hold as many items to cut into as many micro-batches");
    }
    let budget = Budget { max_tokens, padded };
    let fewest: Vec<RankMicroBatches> = shares
        .iter()
        .map(|items| fewest_micro_batches(items, lengths, budget))
        .collect();
    let count = fewest.iter().map(Vec::len).max().unwrap_or(1);
    Ok(shares
        .iter()
        .zip(fewest)
        .map(|(items, least)| exactly(items, least, count, lengths, budget))
        .collect())
}

/// Contiguous rank shards in chunks of `micro` samples (the fixed micro-batches).
fn fixed_plan(n: usize, world: usize, micro: usize) -> Vec<RankMicroBatches> {
    let positions: Vec<usize> = (0..n).collect();
    (0..world)
        .map(|r| {
            rank_shard(&positions, r, world)
                .chunks(micro.max(1))
                .map(<[usize]>::to_vec)
                .collect()
        })
        .collect()
}

/// A token budget and how a micro-batch is charged against it.
#[derive(Clone, Copy, Debug)]
struct Budget {
    max_tokens: usize,
    padded: bool,
}

impl Budget {
    fn cost(&self, part: &[usize], lengths: &[usize]) -> usize {
        let lens = part.iter().map(|&i| lengths[i]);
        if self.padded {
            part.len() * lens.max().unwrap_or(0)
        } else {
            lens.sum()
        }
    }

    fn fits(&self, part: &[usize], lengths: &[usize]) -> bool {
        !part.is_empty() && self.cost(part, lengths) <= self.max_tokens
    }
}

fn budget_plan(lengths: &[usize], world: usize, budget: Budget) -> Vec<RankMicroBatches> {
    let ranks = balance_ranks(lengths, world);
    let fewest: Vec<RankMicroBatches> = ranks
        .iter()
        .map(|items| fewest_micro_batches(items, lengths, budget))
        .collect();
    let count = fewest.iter().map(Vec::len).max().unwrap_or(1);
    ranks
        .iter()
        .zip(fewest)
        .map(|(items, least)| exactly(items, least, count, lengths, budget))
        .collect()
}

/// Splits `0..lengths.len()` over `world` ranks with equal sample counts (as equal as the count allows), minimising
/// the heaviest rank's tokens: the better of Karmarkar–Karp and greedy longest-first.
pub fn balance_ranks(lengths: &[usize], world: usize) -> Vec<Vec<usize>> {
    let all: Vec<usize> = (0..lengths.len()).collect();
    let cap = lengths.len().div_ceil(world.max(1));
    let greedy = greedy_partition(&all, lengths, world, Some(cap));
    if !lengths.len().is_multiple_of(world) {
        return sorted(greedy);
    }
    let kk = karmarkar_karp(&all, lengths, world, true);
    let heaviest = |p: &Vec<Vec<usize>>| max_load(p, lengths);
    sorted(if heaviest(&kk) <= heaviest(&greedy) {
        kk
    } else {
        greedy
    })
}

/// The tokens of the heaviest part of `parts`.
pub fn max_load(parts: &[Vec<usize>], lengths: &[usize]) -> usize {
    parts
        .iter()
        .map(|p| p.iter().map(|&i| lengths[i]).sum::<usize>())
        .max()
        .unwrap_or(0)
}

/// Greedy longest-first: each item, longest first, goes to the lightest part that has fewer than `cap` items.
pub fn greedy_partition(
    items: &[usize],
    lengths: &[usize],
    k: usize,
    cap: Option<usize>,
) -> Vec<Vec<usize>> {
    let mut parts: Vec<(usize, Vec<usize>)> = vec![(0, Vec::new()); k.max(1)];
    for i in by_length_desc(items, lengths) {
        let open = parts
            .iter_mut()
            .filter(|(_, p)| cap.is_none_or(|c| p.len() < c))
            .min_by_key(|(load, _)| *load)
            .expect("the caps hold every item");
        open.0 += lengths[i];
        open.1.push(i);
    }
    parts.into_iter().map(|(_, p)| p).collect()
}

/// Karmarkar–Karp largest differencing of `items` into `k` parts by `lengths`; with `equal_size` every part gets
/// `items.len() / k` items (the count must divide).
pub fn karmarkar_karp(
    items: &[usize],
    lengths: &[usize],
    k: usize,
    equal_size: bool,
) -> Vec<Vec<usize>> {
    let k = k.max(1);
    let sorted = by_length_desc(items, lengths);
    let seeds: Vec<Vec<usize>> = if equal_size {
        sorted.chunks(k).map(<[usize]>::to_vec).collect()
    } else {
        sorted.iter().map(|&i| vec![i]).collect()
    };
    let mut heap = BinaryHeap::new();
    for (id, seed) in seeds.into_iter().enumerate() {
        let mut parts: Vec<Part> = seed.into_iter().map(|i| (lengths[i], vec![i])).collect();
        parts.resize(k, (0, Vec::new()));
        heap.push(State::new(parts, id));
    }
    let mut next_id = heap.len();
    while heap.len() > 1 {
        let (a, b) = (heap.pop().unwrap(), heap.pop().unwrap());
        heap.push(State::new(merge(a.parts, b.parts), next_id));
        next_id += 1;
    }
    heap.pop()
        .map(|s| s.parts.into_iter().map(|(_, p)| p).collect())
        .unwrap_or_else(|| vec![Vec::new(); k])
}

/// A part of a partition: its tokens and its items.
type Part = (usize, Vec<usize>);

/// A partial partition in the differencing heap, ordered by spread (then by age, for determinism).
struct State {
    spread: usize,
    id: Reverse<usize>,
    parts: Vec<Part>,
}

impl State {
    fn new(mut parts: Vec<Part>, id: usize) -> Self {
        parts.sort_by_key(|p| Reverse(p.0));
        let spread = parts[0].0 - parts[parts.len() - 1].0;
        Self {
            spread,
            id: Reverse(id),
            parts,
        }
    }
}

impl PartialEq for State {
    fn eq(&self, other: &Self) -> bool {
        (self.spread, self.id) == (other.spread, other.id)
    }
}
impl Eq for State {}
impl PartialOrd for State {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for State {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        (self.spread, self.id).cmp(&(other.spread, other.id))
    }
}

/// Pairs the heaviest parts of `a` (sorted heaviest first) with the lightest of `b`.
fn merge(a: Vec<Part>, b: Vec<Part>) -> Vec<Part> {
    a.into_iter()
        .zip(b.into_iter().rev())
        .map(|((la, mut pa), (lb, pb))| {
            pa.extend(pb);
            (la + lb, pa)
        })
        .collect()
}

fn by_length_desc(items: &[usize], lengths: &[usize]) -> Vec<usize> {
    let mut v = items.to_vec();
    v.sort_by_key(|&i| (Reverse(lengths[i]), i));
    v
}

/// Each part's items ascending, the parts ordered by their first item.
fn sorted(mut parts: Vec<Vec<usize>>) -> Vec<Vec<usize>> {
    parts.iter_mut().for_each(|p| p.sort_unstable());
    parts.sort_by_key(|p| p.first().copied().unwrap_or(usize::MAX));
    parts
}

/// The fewest micro-batches under `budget` this rank finds for `items`: Karmarkar–Karp at increasing counts from
/// the token lower bound, first-fit decreasing once that is no more.
fn fewest_micro_batches(items: &[usize], lengths: &[usize], budget: Budget) -> RankMicroBatches {
    let ffd = first_fit_decreasing(items, lengths, budget);
    let total: usize = items.iter().map(|&i| lengths[i]).sum();
    let lower = total.div_ceil(budget.max_tokens.max(1)).max(1);
    for m in lower..ffd.len() {
        let kk = karmarkar_karp(items, lengths, m, false);
        if kk.iter().all(|p| budget.fits(p, lengths)) {
            return sorted(kk);
        }
    }
    sorted(ffd)
}

/// First-fit decreasing: each item, longest first, joins the first micro-batch it fits.
fn first_fit_decreasing(items: &[usize], lengths: &[usize], budget: Budget) -> Vec<Vec<usize>> {
    let mut bins: Vec<Vec<usize>> = Vec::new();
    for i in by_length_desc(items, lengths) {
        let fits = |b: &&mut Vec<usize>| {
            let mut with = (*b).clone();
            with.push(i);
            budget.fits(&with, lengths)
        };
        match bins.iter_mut().find(|b| fits(b)) {
            Some(b) => b.push(i),
            None => bins.push(vec![i]),
        }
    }
    bins
}

/// Exactly `count` micro-batches of `items` under `budget`: Karmarkar–Karp at that count when it fits, else the
/// rank's fewest with its heaviest splittable micro-batch halved until there are enough (a subset of a micro-batch
/// under the budget is under it too).
fn exactly(
    items: &[usize],
    least: RankMicroBatches,
    count: usize,
    lengths: &[usize],
    budget: Budget,
) -> RankMicroBatches {
    if least.len() == count {
        return least;
    }
    let kk = karmarkar_karp(items, lengths, count, false);
    if kk.iter().all(|p| budget.fits(p, lengths)) {
        return sorted(kk);
    }
    let mut parts = least;
    while parts.len() < count {
        let Some(at) = (0..parts.len())
            .filter(|&j| parts[j].len() > 1)
            .max_by_key(|&j| (budget.cost(&parts[j], lengths), Reverse(j)))
        else {
            break; // fewer samples than micro-batches: never, as every rank has as many samples as any other
        };
        let halves = karmarkar_karp(&parts[at], lengths, 2, false);
        parts.swap_remove(at);
        parts.extend(halves.into_iter().filter(|h| !h.is_empty()));
    }
    sorted(parts)
}
