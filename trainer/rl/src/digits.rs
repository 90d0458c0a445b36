//! The digit task, as a user would bring it to `ferl grpo`: a tiny random Qwen2 whose word-level tokenizer
//! (vocabulary 16) and chat template are in its model folder, and prompts in verl's RL layout asking for a digit.
//! A tiny model learns it in a few steps on a CPU, so tests, benchmarks (against TRL) and examples use it.

use std::path::Path;

use anyhow::Result;
use serde_json::json;

/// The digit task's tokens: `<pad>` 0, `<s>` 1, `</s>` 2, the digits `0`..`9` 3..=12, `a` `b` `c` 13..=15.
const TOKENS: [&str; 16] = [
    "<pad>", "<s>", "</s>", "0", "1", "2", "3", "4", "5", "6", "7", "8", "9", "a", "b", "c",
];

/// Writes the digit task's model into `dir`: a random tiny Qwen2 (seeded with `seed`) of vocabulary 16 with a
/// word-level `tokenizer.json` and a `tokenizer_config.json` whose chat template renders a conversation as `<s>`
/// followed by its messages' words.
pub fn write_digit_model(dir: &Path, seed: i64) -> Result<()> {
    let config = json!({
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 16, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": false,
        "initializer_range": 0.02, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
        "dtype": "float32"
    });
    std::fs::create_dir_all(dir)?;
    let file = dir.join("config.json");
    std::fs::write(&file, config.to_string())?;
    ferl_trainer::model::init_model(&file, None, dir, seed)?;
    let special = |id: usize| {
        json!({"id": id, "content": TOKENS[id], "single_word": false, "lstrip": false, "rstrip": false,
               "normalized": false, "special": true})
    };
    let vocab: serde_json::Map<String, serde_json::Value> = TOKENS
        .iter()
        .enumerate()
        .map(|(i, t)| (t.to_string(), json!(i)))
        .collect();
    let tokenizer = json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": [special(0), special(1), special(2)],
        "normalizer": null, "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": null,
        "decoder": null, "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<pad>"}
    });
    std::fs::write(dir.join("tokenizer.json"), tokenizer.to_string())?;
    let tokenizer_config = json!({
        "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>",
        "chat_template": "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    });
    std::fs::write(
        dir.join("tokenizer_config.json"),
        tokenizer_config.to_string(),
    )?;
    Ok(())
}

/// The digit task's prompts as JSON lines in verl's RL layout: each digit `copies` times, asked as the user's
/// message, with the digit as its ground truth.
pub fn write_digit_prompts(file: &Path, copies: usize) -> Result<()> {
    let mut text = String::new();
    for d in 0..10 {
        let row = json!({
            "prompt": [{"role": "user", "content": d.to_string()}],
            "data_source": "digits",
            "reward_model": {"ground_truth": d.to_string()},
        });
        text.push_str(&format!("{row}\n").repeat(copies));
    }
    std::fs::write(file, text)?;
    Ok(())
}

/// The `ferl grpo` keys the digit task learns with (besides data, model, reward and run length): 20 prompts × n 8
/// per step at temperature 1, one-token responses, mini-batches of 5 prompts (4 optimizer steps), 2 PPO epochs,
/// lr 3e-3 without weight decay, a KL loss (`low_var_kl`, 0.001) to the initial weights, clip ratios 0.2/0.28,
/// seed 42. With these the mean reward goes from about 0.06 to 0.8 in about 11 steps.
pub const GRPO_KEYS: &[&str] = &[
    "data.train_batch_size=20",
    "data.max_prompt_length=8",
    "data.max_response_length=1",
    "actor_rollout_ref.rollout.n=8",
    "actor_rollout_ref.actor.ppo_mini_batch_size=5",
    "actor_rollout_ref.actor.ppo_epochs=2",
    "actor_rollout_ref.actor.shuffle=true",
    "actor_rollout_ref.actor.clip_ratio_high=0.28",
    "actor_rollout_ref.actor.use_kl_loss=true",
    "actor_rollout_ref.actor.kl_loss_coef=0.001",
    "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
    "actor_rollout_ref.actor.optim.lr=3e-3",
    "actor_rollout_ref.actor.optim.weight_decay=0",
    "actor_rollout_ref.model.enable_gradient_checkpointing=false",
    "algorithm.adv_estimator=grpo",
    "trainer.device=cpu",
    "trainer.seed=42",
];
