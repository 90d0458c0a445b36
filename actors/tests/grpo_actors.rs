//! GRPO's roles as actors on an embedded cluster (workers run `ferl-actors-worker`), on the digit task of
//! `trainer/rl/tests/grpo_learns.rs`: a tiny random Qwen2 (vocabulary 16: pad 0, BOS 1, EOS 2, digits 3..=12)
//! prompted with `[BOS, d]`, twice per digit, earning 1 when its first response token is `d`. Asserted:
//! - `separate_groups_learn_and_match_the_one_process_trainer`: with the policy and the rollout on separate
//!   resource groups, the mean reward reaches 0.8 within [`MAX_STEPS`] steps, and every step's responses, rewards
//!   and metrics equal those of the one-process `GrpoTrainer` run beside it (same seed, same initial weights;
//!   within 1e-6 — in practice bit for bit).
//! - `colocated_placement_learns_and_matches_the_one_process_trainer`: the same with the policy and the rollout in
//!   one bundle of one group.
//! - `run_grpo_on_groups_returns_the_one_process_metrics`: the library loop's 3 steps (colocated) return the
//!   one-process trainer's metrics plus the sync's, and free their resource groups.
//! - `weight_sync_gives_rollouts_the_policy_weights`: after a step (whose sync moved the updated weights to two
//!   rollout actors), each rollout actor's greedy generation equals that of a fresh `RolloutModel` built from the
//!   policy's exported weights (and differs from the initial model's); the sync moved exactly the model's fp32
//!   parameter bytes. It also prints the bytes, seconds and bandwidth of syncs of a wider model (about 18 MB).
//!
//! Run them one per process (`cargo nextest run -p ferl-actors --test grpo_actors`, or `--test-threads=1`).

#[path = "../../trainer/rl/tests/common/digits.rs"]
mod digits;

use digits::{assert_same_step, model_dir, prompts, reward, settings, BOS, EOS, MAX_STEPS};
use ferl_actors::rl::weights::params_in_layout;
use ferl_actors::rl::{
    run_grpo_on_groups, spawn_roles, sync_weights, ExportWeights, Generate, GrpoDriver, GrpoRoles,
    Placement, RoleOptions, Sampling, WireDtype,
};
use ferl_rl::GrpoTrainer;
use ferl_runtime::{Cluster, HeadOptions, NodeOptions};
use ferl_trainer::model::{init_model, load_model};
use ferl_trainer::params::LocalParams;
use ferl_trainer::rollout::{Generated, GenerationConfig, RolloutModel, SamplingParams};
use std::path::Path;
use std::time::Instant;
use tch::{Device, Kind};

/// An embedded cluster of 4 CPUs whose workers run `ferl-actors-worker`, with its session folders in `tmp`.
async fn cluster(tmp: &Path) -> Cluster {
    // Each test runs in its own process (nextest, or --test-threads=1), before any runtime thread exists.
    std::env::set_var("FERL_TMPDIR", tmp);
    let opts = HeadOptions::new()
        .node(NodeOptions::new().num_cpus(4.0).num_gpus(0))
        .worker_binary(env!("CARGO_BIN_EXE_ferl-actors-worker"));
    ferl_runtime::init(opts).await.unwrap()
}

/// A fresh one-process trainer of the initial weights in `model`.
fn one_process(model: &Path) -> GrpoTrainer<LocalParams> {
    digits::one_process(model, settings())
}

/// Steps `driver` and the one-process trainer `one` in lockstep until the mean reward reaches 0.8 (asserted within
/// [`MAX_STEPS`]): every step's responses, rewards and metrics agree. Returns the curve.
async fn learn(
    driver: &mut GrpoDriver,
    one: &mut GrpoTrainer<LocalParams>,
    what: &str,
) -> Vec<f64> {
    let prompts = prompts();
    let started = Instant::now();
    let (mut curve, mut worst) = (Vec::new(), 0.0f64);
    while curve.last().is_none_or(|&r: &f64| r < 0.8) && curve.len() < MAX_STEPS {
        let got = driver.step(&prompts).await.unwrap();
        let want = one.step(&prompts).unwrap();
        worst = worst.max(assert_same_step(
            &want,
            &got,
            &format!("{what}, step {}", got.step),
        ));
        let m = &got.metrics;
        for (k, v) in m {
            assert!(v.is_finite(), "{what}: {k} = {v}");
        }
        if got.step == 1 {
            println!(
                "{what}, step 1: reward {:.4} pg_loss {:+.6} kl_loss {:.6} grad_norm {:.6}; weight sync {} bytes in \
                 {:.4} s ({:.1} MB/s)",
                m["critic/score/mean"],
                m["actor/pg_loss"],
                m["actor/kl_loss"],
                m["actor/grad_norm"],
                m["perf/weight_sync_bytes"],
                m["timing_s/update_weights"],
                m["perf/weight_sync_mb_per_s"]
            );
        }
        curve.push(m["critic/score/mean"]);
    }
    let rounded: Vec<f64> = curve
        .iter()
        .map(|r| (r * 1000.0).round() / 1000.0)
        .collect();
    println!(
        "{what}: mean reward per step {rounded:?}; every step equals the one-process trainer's (largest metric \
         difference {worst:e}); {} steps of both in {:.1} s",
        curve.len(),
        started.elapsed().as_secs_f64()
    );
    assert!(
        curve[0] < 0.25,
        "{what}: solved at random init: {}",
        curve[0]
    );
    assert!(
        *curve.last().unwrap() >= 0.8,
        "{what}: mean reward never reached 0.8 in {MAX_STEPS} steps: {rounded:?}"
    );
    curve
}

/// GRPO on roles placed as `placement` learns the task, step for step as the one-process trainer does.
async fn learns_like_one_process(placement: Placement, groups: usize, what: &str) {
    tch::set_num_threads(1);
    let dir = tempfile::tempdir().unwrap();
    let model = model_dir(dir.path());
    let mut one = one_process(&model);
    let cluster = cluster(dir.path()).await;
    let opts = RoleOptions::default();
    let roles = spawn_roles(&cluster, &settings(), &model, placement, &opts)
        .await
        .unwrap();
    assert_eq!(roles.groups.len(), groups);
    let mut driver = GrpoDriver::new(&cluster, roles, settings(), reward()).unwrap();
    learn(&mut driver, &mut one, what).await;
    driver.shutdown().await.unwrap();
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn separate_groups_learn_and_match_the_one_process_trainer() {
    learns_like_one_process(Placement::Separate, 2, "separate").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn colocated_placement_learns_and_matches_the_one_process_trainer() {
    learns_like_one_process(Placement::Colocated, 1, "colocated").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_grpo_on_groups_returns_the_one_process_metrics() {
    tch::set_num_threads(1);
    let dir = tempfile::tempdir().unwrap();
    let model = model_dir(dir.path());
    let mut one = one_process(&model);
    let cluster = cluster(dir.path()).await;
    let (s, p) = (settings(), prompts());
    let got = run_grpo_on_groups(&cluster, &s, &model, &p, reward(), 3, Placement::Colocated)
        .await
        .unwrap();
    assert_eq!(got.len(), 3);
    for (i, metrics) in got.iter().enumerate() {
        let want = one.step(&p).unwrap();
        for (k, v) in &want.metrics {
            if !k.starts_with("timing_s/") {
                assert!((v - metrics[k]).abs() <= 1e-6, "step {}: {k}", i + 1);
            }
        }
        for k in [
            "timing_s/update_weights",
            "perf/weight_sync_bytes",
            "perf/weight_sync_mb_per_s",
        ] {
            assert!(metrics[k] > 0.0, "step {}: {k}", i + 1);
        }
    }
    let status = cluster.status().await.unwrap();
    let groups = status["groups"]
        .as_array()
        .expect("the status lists groups");
    assert!(groups.is_empty(), "the groups are freed: {groups:?}");
    cluster.shutdown().await;
}

/// Each rollout actor's greedy responses (and their log-probabilities) to the prompts equal those of a fresh
/// `RolloutModel` built from the policy's exported weights, and differ from the initial model's.
async fn assert_rollouts_generate_with_policy_weights(roles: &GrpoRoles, model: &Path) {
    let loaded = load_model(model).unwrap();
    let payload = roles
        .policy
        .call(ExportWeights {
            dtype: WireDtype::F32,
        })
        .await
        .unwrap();
    let params = params_in_layout(&loaded.layout, payload.tensors().unwrap()).unwrap();
    let fresh = |params: &[tch::Tensor]| {
        let cfg = loaded.config.clone();
        RolloutModel::from_params(cfg, &loaded.layout, params, Device::Cpu, Kind::Float).unwrap()
    };
    let (synced, initial) = (fresh(&params), fresh(&loaded.params));
    let greedy = Sampling::from(SamplingParams::default());
    let mut msg = Generate::new(&prompts(), &settings(), 0, 0);
    (msg.n, msg.sampling) = (1, greedy);
    let config = GenerationConfig {
        max_response_length: msg.max_response_length as usize,
        sampling: greedy.into(),
        eos_token_ids: msg.eos_token_ids.clone(),
        pad_token_id: msg.pad_token_id,
        first_row: 0,
    };
    let want = synced.generate(&msg.prompts, &config).unwrap();
    let before = initial.generate(&msg.prompts, &config).unwrap();
    let log_probs = |g: &[Generated]| g.iter().map(|g| g.log_probs.clone()).collect::<Vec<_>>();
    assert_ne!(
        log_probs(&want),
        log_probs(&before),
        "the step changed the weights"
    );
    for r in 0..roles.rollouts.len() {
        let got = roles.rollouts.rank(r).call(msg.clone()).await.unwrap();
        for (i, g) in want.iter().enumerate() {
            assert_eq!(got.responses[i], g.response, "rollout {r}, prompt {i}");
            assert_eq!(got.log_probs[i], g.log_probs, "rollout {r}, prompt {i}");
        }
    }
}

/// fp32 parameter bytes of the model in `dir`.
fn param_bytes(dir: &Path) -> u64 {
    let loaded = load_model(dir).unwrap();
    loaded.params.iter().map(|t| t.numel() as u64 * 4).sum()
}

/// Syncs a wider model (vocabulary 4096, hidden 256, 4 layers: about 18 MB of fp32) three times to two rollout
/// actors and prints the bytes, seconds and bandwidth of each.
async fn measure_wide_sync(cluster: &Cluster, dir: &Path) {
    let wide = dir.join("wide");
    std::fs::create_dir_all(&wide).unwrap();
    let config = serde_json::json!({
        "model_type": "qwen2", "vocab_size": 4096, "hidden_size": 256, "intermediate_size": 512,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": false,
        "initializer_range": 0.02, "bos_token_id": BOS, "eos_token_id": EOS, "dtype": "float32"
    });
    std::fs::write(wide.join("config.json"), config.to_string()).unwrap();
    init_model(&wide.join("config.json"), None, &wide.join("model"), 7).unwrap();
    let model = wide.join("model");
    let opts = RoleOptions {
        rollouts: 2,
        ..RoleOptions::default()
    };
    let roles = spawn_roles(cluster, &settings(), &model, Placement::Separate, &opts)
        .await
        .unwrap();
    for i in 1..=3 {
        let sync = sync_weights(&roles.policy, &roles.rollouts, WireDtype::F32)
            .await
            .unwrap();
        assert_eq!(sync.bytes, param_bytes(&model));
        println!(
            "wide model, sync {i} to 2 rollout actors: {} bytes in {:.4} s (export {:.4} s, fetch + rebuild \
             {:.4} s): {:.0} MB/s",
            sync.bytes,
            sync.seconds,
            sync.export_seconds,
            sync.load_seconds,
            sync.metrics()["perf/weight_sync_mb_per_s"]
        );
    }
    roles.remove(cluster).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn weight_sync_gives_rollouts_the_policy_weights() {
    tch::set_num_threads(1);
    let dir = tempfile::tempdir().unwrap();
    let model = model_dir(dir.path());
    let cluster = cluster(dir.path()).await;
    let opts = RoleOptions {
        rollouts: 2,
        ..RoleOptions::default()
    };
    let roles = spawn_roles(&cluster, &settings(), &model, Placement::Separate, &opts)
        .await
        .unwrap();
    let mut driver = GrpoDriver::new(&cluster, roles, settings(), reward()).unwrap();
    let step = driver.step(&prompts()).await.unwrap(); // updates the policy, then syncs
    assert_eq!(
        step.metrics["perf/weight_sync_bytes"],
        param_bytes(&model) as f64
    );
    let roles = driver.roles();
    let sync = sync_weights(&roles.policy, &roles.rollouts, WireDtype::F32)
        .await
        .unwrap();
    println!(
        "tiny model, sync to 2 rollout actors: {} bytes in {:.4} s (export {:.4} s, read + rebuild {:.4} s)",
        sync.bytes, sync.seconds, sync.export_seconds, sync.load_seconds
    );
    assert_eq!(sync.bytes, param_bytes(&model));
    let agent = cluster
        .object_stats(Some(&roles.policy.node()))
        .await
        .unwrap();
    assert_eq!(
        (agent.fetched, agent.cached),
        (0, 0),
        "the rollouts mapped the policy's blob: no node agent copied it"
    );
    assert_rollouts_generate_with_policy_weights(roles, &model).await;
    driver.shutdown().await.unwrap();
    measure_wide_sync(&cluster, dir.path()).await;
    cluster.shutdown().await;
}

/// A driver saved after step 2 and loaded into freshly spawned roles runs step 3 as an uninterrupted one-process
/// run does (the policy actor's SaveState/LoadState are GrpoTrainer's files; the load syncs the rollouts).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_saved_driver_resumes_into_new_roles_as_an_uninterrupted_run() {
    tch::set_num_threads(1);
    let dir = tempfile::tempdir().unwrap();
    let model = model_dir(dir.path());
    let mut one = one_process(&model);
    let cluster = cluster(dir.path()).await;
    let (opts, prompts, s) = (RoleOptions::default(), prompts(), settings());
    let spawn = || spawn_roles(&cluster, &s, &model, Placement::Separate, &opts);
    let mut first =
        GrpoDriver::new(&cluster, spawn().await.unwrap(), settings(), reward()).unwrap();
    for _ in 0..2 {
        let got = first.step(&prompts).await.unwrap();
        assert_same_step(&one.step(&prompts).unwrap(), &got, "before the save");
    }
    let saved = dir.path().join("global_step_2");
    first.save(&saved).await.unwrap();
    first.shutdown().await.unwrap();
    let mut resumed =
        GrpoDriver::new(&cluster, spawn().await.unwrap(), settings(), reward()).unwrap();
    resumed.load(&saved).await.unwrap();
    let got = resumed.step(&prompts).await.unwrap();
    assert_eq!(got.step, 3);
    assert_same_step(&one.step(&prompts).unwrap(), &got, "resumed step 3");
    resumed.shutdown().await.unwrap();
    cluster.shutdown().await;
}
