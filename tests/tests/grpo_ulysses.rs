//! `ferl grpo` with Ulysses sequence parallelism (`actor_rollout_ref.actor.ulysses_sequence_parallel_size`, verl's
//! key) on the GSM8K fixture and the tiny Qwen2: groups of consecutive ranks split every forward's sequences (old and
//! reference log-probabilities, the update), each rank of a group generating and scoring rows of its own. Every run
//! equals the one-process run within 1e-5, whatever the loss aggregation (token means and per-sequence means, whose
//! lengths span the group's slices), the layout (padded or packed) and the data-parallel groups beside it; keys that
//! cannot work are refused by key before anything runs.

use ferl_tests::output_text as text;
use ferl_tests::rl::*;
use ferl_tests::*;

const SP2: &str = "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2";

#[test]
fn grpo_with_ulysses_equals_one_process_on_every_aggregation_and_layout() {
    let dir = fixture();
    let d = dir.path();
    // 2 prompts × 4 responses: 8 rows, two mini-batches of 4 per step, micro-batches of 2 rows.
    let shape = [
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=1",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    ];
    let run = |name: &str, extra: &[&str]| {
        let out = run_ferl(&grpo_args(d, name, 3, &[&shape[..], extra].concat()));
        assert!(out.status.success(), "{name}: {}", text(&out));
        metrics(&d.join(name))
    };
    let two = ["--nproc-per-node", "2", SP2];
    let one = run("w1", &[]);
    assert_same_steps("SP 2 on 2 ranks", &one, &run("sp2", &two), 1e-5);
    let four = ["--nproc-per-node", "4", SP2];
    assert_same_steps("SP 2 × DP 2 on 4 ranks", &one, &run("sp2dp2", &four), 1e-5);
    // Per-sequence means over sequences split between the group's ranks, packed rows.
    let seq_mean = [
        "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean",
        "actor_rollout_ref.model.use_remove_padding=true",
    ];
    let one_seq = run("w1seq", &seq_mean);
    let sp_seq = run("sp2seq", &[&seq_mean[..], &two].concat());
    assert_same_steps("SP 2, seq-mean-token-mean, packed", &one_seq, &sp_seq, 1e-5);
}

#[test]
fn ulysses_keys_that_cannot_work_are_refused_by_key_before_anything_runs() {
    let dir = fixture();
    let d = dir.path();
    let cases: [(&[&str], &str); 3] = [
        (
            &["--nproc-per-node", "2", "actor_rollout_ref.actor.ulysses_sequence_parallel_size=4"],
            "actor_rollout_ref.actor.ulysses_sequence_parallel_size=4 must divide the run's 2 ranks",
        ),
        (
            // The tiny model has 2 query heads.
            &["--nproc-per-node", "4", "actor_rollout_ref.actor.ulysses_sequence_parallel_size=4"],
            "num_attention_heads=2",
        ),
        (
            &["--nproc-per-node", "2", SP2, "actor_rollout_ref.ref.ulysses_sequence_parallel_size=1"],
            "actor_rollout_ref.ref.ulysses_sequence_parallel_size=1",
        ),
    ];
    for (i, (extra, want)) in cases.iter().enumerate() {
        let name = format!("bad{i}");
        let out = run_ferl(&grpo_args(d, &name, 1, extra));
        let said = text(&out);
        assert!(!out.status.success(), "{extra:?}: {said}");
        assert!(said.contains(want), "{extra:?}: {said}");
        assert!(said.contains("ulysses_sequence_parallel_size"), "{said}");
        assert!(
            !d.join(&name).exists(),
            "{extra:?}: a refused run left its folder"
        );
    }
}
