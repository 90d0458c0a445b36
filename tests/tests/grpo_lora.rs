//! `ferl grpo` with LoRA (`actor_rollout_ref.model.lora_rank`, verl's keys) on the GSM8K fixture and the tiny Qwen2:
//! the adapters train on every launch path with the same steps, the checkpoint holds them in PEFT's format and
//! resumes at another world size, the reference of the KL loss is the base model with the adapters off (verl's, no
//! second copy), and LoRA keys that cannot work are refused by key before anything runs.

use ferl_tests::output_text as text;
use ferl_tests::rl::*;
use ferl_tests::*;

/// LoRA of rank 4 on every linear projection; a learning rate large enough that the adapters move visibly.
const LORA: [&str; 4] = [
    "actor_rollout_ref.model.lora_rank=4",
    "actor_rollout_ref.model.lora_alpha=8",
    "actor_rollout_ref.model.target_modules=all-linear",
    "actor_rollout_ref.actor.optim.lr=5e-3",
];

#[test]
fn lora_grpo_equals_across_world_sizes_resumes_and_keeps_a_peft_adapter() {
    let dir = fixture();
    let d = dir.path();
    let run = |name: &str, steps: usize, extra: &[&str]| {
        let out = run_ferl(&grpo_args(d, name, steps, &[&LORA[..], extra].concat()));
        assert!(out.status.success(), "{name}: {}", text(&out));
        metrics(&d.join(name))
    };
    let one = run("w1", 3, &[]);
    let two = run("w2", 3, &["--nproc-per-node", "2"]);
    assert_same_steps("LoRA on 2 ranks", &one, &two, 1e-5);
    run("r21", 2, &["--nproc-per-node", "2"]);
    let resumed = run("r21", 3, &[]);
    assert_same_steps("LoRA: 2 ranks resumed in 1 process", &one, &resumed, 1e-5);
    // Fresh adapters (B = 0) leave the policy equal to its base, so the first KL is 0; after two updates the
    // adapters have moved away from the base the reference stays at.
    assert_eq!(number(&one[0], "actor/kl_loss"), 0.0);
    assert!(number(&one[2], "actor/kl_loss") > 0.0, "{}", one[2]);
    let adapter = d.join("w1/global_step_3/lora_adapter");
    let config = std::fs::read_to_string(adapter.join("adapter_config.json")).unwrap();
    let config: serde_json::Value = serde_json::from_str(&config).unwrap();
    assert_eq!(
        (config["r"].as_i64(), config["lora_alpha"].as_f64()),
        (Some(4), Some(8.0))
    );
    assert!(adapter.join("adapter_model.safetensors").is_file());
}

/// A policy started from a trained adapter (`lora_adapter_path`) differs from its base from the first step on: the
/// reference is the base without adapters, so the first step's KL is above 0 (a frozen copy of the starting policy
/// would give exactly 0).
#[test]
fn the_reference_of_a_lora_policy_is_its_base_without_adapters() {
    let dir = fixture();
    let d = dir.path();
    let trained = grpo_args(d, "trained", 3, &LORA);
    let out = run_ferl(&trained);
    assert!(out.status.success(), "{}", text(&out));
    let path = d.join("trained/global_step_3/lora_adapter");
    let from = format!(
        "actor_rollout_ref.model.lora_adapter_path={}",
        path.display()
    );
    let out = run_ferl(&grpo_args(d, "from_adapter", 1, &[from.as_str()]));
    assert!(out.status.success(), "{}", text(&out));
    let first = &metrics(&d.join("from_adapter"))[0];
    let kl = number(first, "actor/kl_loss");
    assert!(kl > 1e-6, "first-step KL against the base: {kl}");
    println!("first-step KL of a trained adapter against its base: {kl:.3e}");
}

#[test]
fn lora_keys_that_cannot_work_are_refused_by_key_before_anything_runs() {
    let dir = fixture();
    let d = dir.path();
    let cases = [
        (
            "actor_rollout_ref.model.target_modules=[lm_head]",
            "`lm_head` is not supported",
        ),
        (
            "actor_rollout_ref.model.target_modules=[nothing_here]",
            "`nothing_here` matches no module",
        ),
    ];
    for (i, (key, want)) in cases.iter().enumerate() {
        let name = format!("bad{i}");
        let extra = [LORA[0], key];
        let out = run_ferl(&grpo_args(d, &name, 1, &extra));
        let said = text(&out);
        assert!(!out.status.success(), "{key}: {said}");
        assert!(said.contains("actor_rollout_ref.model"), "{key}: {said}");
        assert!(said.contains(want), "{key}: {said}");
        assert!(
            !d.join(&name).exists(),
            "{key}: a refused run left its folder"
        );
    }
}
