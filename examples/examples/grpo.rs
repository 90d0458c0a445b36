//! GRPO with its roles as actors, driven from this process (verl's single controller): a policy actor on one
//! resource group, two rollout actors on another. Each step is `GrpoDriver::step`: the one GRPO step every path runs
//! (`ferl_rl::GrpoStep`: generate → reward → old and reference log-probabilities → advantages → update →
//! weight sync) over actor-backed roles; this file only chooses the task, the reward, the settings and the
//! placement.
//!
//! The task: a tiny random Qwen2 made in a temp folder (vocabulary 16: BOS 1, EOS 2, digits 3..=12), prompted with
//! `[BOS, d]`, earns 1 when its first response token is `d`. The mean reward climbs from about 0.06 to over 0.8.
//! Run: `cargo run -p ferl-examples --example grpo` (CPU, no download, well under a minute).
use ferl::actors::rl::{spawn_roles, GrpoDriver, Placement, RoleOptions};
use ferl::rl::{
    ActorLossConfig, ClipConfig, FnReward, GrpoPrompt, GrpoSettings, MicroBatching, RewardRow,
};
use ferl::trainer::optim::AdamWConfig;
use ferl::{HeadOptions, NodeOptions};

const STEPS: u64 = 20;
const TINY_QWEN2: &str = r#"{"model_type": "qwen2", "vocab_size": 16, "hidden_size": 32,
  "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
  "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": false, "initializer_range": 0.02,
  "bos_token_id": 1, "eos_token_id": 2, "dtype": "float32"}"#;

/// `grpo_learns.rs`'s settings: 8 responses per prompt, 2 PPO epochs of 4 mini-batches, a KL loss, lr 3e-3.
fn settings() -> GrpoSettings {
    GrpoSettings {
        n: 8,
        seed: 42,
        max_response_length: 3,
        eos_token_ids: vec![2],
        ppo_mini_batch_size: 5,
        ppo_micro_batching: MicroBatching::Rows(16),
        log_prob_micro_batching: MicroBatching::Rows(40),
        ref_log_prob_micro_batching: MicroBatching::Rows(40),
        ppo_epochs: 2,
        shuffle: true,
        loss: ActorLossConfig {
            policy: ClipConfig {
                clip_ratio_high: Some(0.28),
                ..ClipConfig::default()
            },
            use_kl_loss: true,
            ..ActorLossConfig::default()
        },
        lr: 3e-3,
        optim: AdamWConfig {
            weight_decay: 0.0,
            ..GrpoSettings::default().optim
        },
        ..GrpoSettings::default()
    }
}

/// `[BOS, d]` twice for each digit `d`.
fn prompts() -> Vec<GrpoPrompt> {
    (3..=12i64)
        .flat_map(|d| [d, d])
        .map(|d| GrpoPrompt {
            ids: vec![1, d],
            ..GrpoPrompt::default()
        })
        .collect()
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    ferl::actors::ensure_linked(); // keeps the role actors registered in this binary
    ferl::enter_worker_mode_if_spawned(); // workers are this binary, re-run in worker mode
    let dir = std::env::temp_dir().join(format!("ferl-grpo-example-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    std::fs::write(dir.join("config.json"), TINY_QWEN2)?;
    let model = dir.join("model");
    ferl::trainer::model::init_model(&dir.join("config.json"), None, &model, 7)?;
    let (s, prompts) = (settings(), prompts());
    let reward = FnReward::new("echo_digit", |r: &RewardRow<'_>| {
        f64::from(r.response_ids.first() == r.prompt_ids.get(1))
    });

    let cluster = ferl::init(HeadOptions::new().node(NodeOptions::new().num_cpus(3.0))).await?;
    let opts = RoleOptions {
        rollouts: 2,
        ..RoleOptions::default()
    };
    let roles = spawn_roles(&cluster, &s, &model, Placement::Separate, &opts).await?;
    let mut driver = GrpoDriver::new(&cluster, roles, s, Box::new(reward))?;
    for _ in 0..STEPS {
        let out = driver.step(&prompts).await?;
        let m = |key: &str| out.metrics.get(key).copied().unwrap_or(f64::NAN);
        println!(
            "step {:2}: mean reward {:.3}  pg_loss {:+.4}  weight sync {} bytes in {:.1} ms",
            out.step,
            m("critic/score/mean"),
            m("actor/pg_loss"),
            m("perf/weight_sync_bytes"),
            m("timing_s/update_weights") * 1e3
        );
    }
    driver.shutdown().await?;
    cluster.shutdown().await;
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}
