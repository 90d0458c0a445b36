//! GRPO with its roles as actors, the loop written out in the driver (verl's single controller): a policy actor on
//! one resource group, two rollout actors on another, and per step generate → reward → old and reference
//! log-probabilities → advantages → update → weight sync. Change any stage here to change the algorithm.
//!
//! The task: a tiny random Qwen2 made in a temp folder (vocabulary 16: BOS 1, EOS 2, digits 3..=12), prompted with
//! `[BOS, d]`, earns 1 when its first response token is `d`. The mean reward climbs from about 0.06 to over 0.8.
//! Run: `cargo run -p ferl-examples --example grpo` (CPU, no download, well under a minute).
use ferl::actors::rl::{
    spawn_roles, sync_weights, token_matrix, ComputeLogProb, Generate, Generations, GrpoRoles,
    Placement, RoleOptions, UpdatePolicy, WeightSync, WireDtype,
};
use ferl::runtime::split_even;
use ferl::trainer::optim::AdamWConfig;
use ferl::trainer::rl::{
    derive_seed, grpo_outcome_advantage, score_batch, ActorLossConfig, ActorUpdateConfig, FnReward,
    GrpoPrompt, GrpoSettings, PolicyLossConfig, Reward, RewardRow,
};
use ferl::{HeadOptions, NodeOptions};
use tch::Device;

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
        ppo_micro_batch_size: 16,
        ppo_epochs: 2,
        shuffle: true,
        loss: ActorLossConfig {
            policy: PolicyLossConfig {
                clip_ratio_high: Some(0.28),
                ..PolicyLossConfig::default()
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

/// One GRPO step (0-based `step`) on the roles; returns the mean reward, `actor/pg_loss` and the weight sync.
async fn grpo_step(
    roles: &GrpoRoles,
    s: &GrpoSettings,
    prompts: &[GrpoPrompt],
    reward: &mut dyn Reward,
    step: u64,
) -> anyhow::Result<(f64, f64, WeightSync)> {
    let (policy, rollouts) = (&roles.policy, &roles.rollouts);
    // 1. generate: each rollout actor answers an even share of the prompts, with a seed of its own
    let seed = derive_seed(s.seed, step, 0);
    let chunks = split_even(prompts.to_vec(), rollouts.len());
    let messages = (chunks.iter().enumerate())
        .map(|(r, chunk)| Generate::new(chunk, s, seed + r as u64))
        .collect();
    let mut all = Generations::default();
    for g in rollouts.call_each(messages).await? {
        all.responses.extend(g.responses);
        all.log_probs.extend(g.log_probs);
        all.stopped_at_eos.extend(g.stopped_at_eos);
    }
    let mut batch = all.into_batch(prompts, s.n, None)?;
    // 2. reward, in the driver
    let rewards = score_batch(reward, &batch)?;
    let mean = rewards.iter().sum::<f64>() / rewards.len() as f64;
    batch.rewards = Some(rewards);
    // 3. old and reference log-probabilities, on the policy actor
    let t = s.temperature;
    let old = policy
        .call(ComputeLogProb::policy(&batch, 40, t, false))
        .await?;
    batch.old_log_probs = Some(token_matrix(&batch, &old.log_probs, Device::Cpu)?);
    let reference = policy
        .call(ComputeLogProb::reference(&batch, 40, t))
        .await?;
    batch.ref_log_probs = Some(token_matrix(&batch, &reference.log_probs, Device::Cpu)?);
    // 4. advantages, in the driver: GRPO's group-normalised scores
    let mask = batch.response_mask(Device::Cpu);
    let token_rewards = batch.token_level_rewards(Device::Cpu)?;
    let adv = grpo_outcome_advantage(&token_rewards, &mask, &batch.uids(), 1e-6, true)?;
    batch.advantages = Some(adv);
    // 5. update, on the policy actor
    let cfg = ActorUpdateConfig {
        loss: s.loss,
        ppo_mini_batch_size: s.ppo_mini_batch_size,
        rollout_n: s.n,
        ppo_micro_batch_size: s.ppo_micro_batch_size,
        ppo_epochs: s.ppo_epochs,
        shuffle: s.shuffle,
        shuffle_seed: derive_seed(s.seed, step, 1),
        grad_clip: s.grad_clip,
        temperature: t,
    };
    let actor = policy.call(UpdatePolicy::new(&batch, &cfg)?).await?;
    let pg_loss = actor
        .iter()
        .find(|(k, _)| k == "actor/pg_loss")
        .map_or(0.0, |p| p.1);
    // 6. weight sync: the policy publishes into the object store, every rollout actor reads
    let sync = sync_weights(policy, rollouts, WireDtype::F32).await?;
    Ok((mean, pg_loss, sync))
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
    let mut reward = FnReward::new("echo_digit", |r: &RewardRow<'_>| {
        f64::from(r.response_ids.first() == r.prompt_ids.get(1))
    });

    let cluster = ferl::init(HeadOptions::new().node(NodeOptions::new().num_cpus(3.0))).await?;
    let opts = RoleOptions {
        rollouts: 2,
        ..RoleOptions::default()
    };
    let roles = spawn_roles(&cluster, &s, &model, Placement::Separate, &opts).await?;
    for step in 0..STEPS {
        let (mean, pg_loss, sync) = grpo_step(&roles, &s, &prompts, &mut reward, step).await?;
        println!(
            "step {:2}: mean reward {mean:.3}  pg_loss {pg_loss:+.4}  weight sync {} bytes in {:.1} ms",
            step + 1,
            sync.bytes,
            sync.seconds * 1e3
        );
    }
    roles.remove(&cluster).await?;
    cluster.shutdown().await;
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}
