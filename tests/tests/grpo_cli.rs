//! `ferl grpo` run as a user would, on verl's GSM8K parquet and the tiny Qwen2: verl's metric names in
//! `metrics.jsonl`, `global_step_N/` checkpoints with `latest_checkpointed_iteration.txt`, a resumed run that equals
//! an uninterrupted one, a reward plugin named by `custom_reward_function.path`, and keys it cannot honour refused
//! by name. The tiny random model scores 0 on GSM8K, so the entropy bonus (`entropy_coeff`) is what moves the weights
//! between steps: without it every step would be the same and the resume check would prove nothing.

use std::path::{Path, PathBuf};
use std::process::Command;

use ferl_tests::cluster::LoopbackCluster;
use ferl_tests::rl::*;
use ferl_tests::*;
use serde_json::Value;

use ferl_tests::output_text as text;

const VERL_KEYS: [&str; 10] = [
    "critic/score/mean",
    "critic/rewards/mean",
    "actor/pg_loss",
    "actor/kl_loss",
    "actor/pg_clipfrac",
    "actor/entropy",
    "response_length/mean",
    "timing_s/gen",
    "timing_s/update_actor",
    "timing_s/update_weights",
];

#[test]
fn grpo_logs_verl_metrics_saves_steps_and_resumes_to_the_same_run() {
    let dir = fixture();
    let d = dir.path();
    // The csv logger is a plugin (beside the binary), as for `ferl sft`.
    let csv_too = "trainer.logger=[console,jsonl,csv]";
    let out = run_ferl(&grpo_args(d, "a", 3, &[csv_too]));
    assert!(out.status.success(), "{}", text(&out));
    let a = metrics(&d.join("a"));
    assert_eq!(a.len(), 3, "one metrics line per step");
    for key in VERL_KEYS {
        number(&a[2], key);
    }
    let csv =
        std::fs::read_to_string(d.join("a/metrics.csv")).expect("the csv plugin's metrics.csv");
    for step in 1..=3 {
        assert!(
            csv.lines()
                .any(|l| l.starts_with(&format!("{step},critic/score/mean,"))),
            "step {step} is not in metrics.csv:\n{csv}"
        );
    }
    for step in 1..=3 {
        assert!(d.join(format!("a/global_step_{step}")).is_dir());
    }
    let latest = std::fs::read_to_string(d.join("a/latest_checkpointed_iteration.txt")).unwrap();
    assert_eq!(latest.trim(), "3");
    let moved = (number(&a[0], "actor/entropy") - number(&a[2], "actor/entropy")).abs();
    assert!(
        moved > 1e-6,
        "the entropy bonus moved the weights ({moved})"
    );

    let first = run_ferl(&grpo_args(d, "b", 2, &[]));
    assert!(first.status.success(), "{}", text(&first));
    let resumed = run_ferl(&grpo_args(d, "b", 3, &[]));
    assert!(resumed.status.success(), "{}", text(&resumed));
    assert!(
        text(&resumed).contains("resumed from"),
        "{}",
        text(&resumed)
    );
    let b = metrics(&d.join("b"));
    assert_eq!(b.len(), 3, "two steps, then the resumed third");
    for key in VERL_KEYS.iter().filter(|k| !k.starts_with("timing_s")) {
        let (x, y) = (number(&a[2], key), number(&b[2], key));
        assert!(
            (x - y).abs() <= 1e-6 * x.abs().max(1.0),
            "{key}: uninterrupted {x}, resumed {y}"
        );
    }
}

#[test]
fn grpo_on_2_and_4_ranks_equals_one_process_and_resumes_across_world_sizes() {
    let dir = fixture();
    let d = dir.path();
    // 2 prompts × 4 responses: 8 rows, shared by 1, 2 or 4 ranks; two mini-batches per step.
    let shape = [
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=1",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
    ];
    let run = |name: &str, steps: usize, extra: &[&str]| {
        let args = grpo_args(d, name, steps, &[&shape[..], extra].concat());
        let out = run_ferl(&args);
        assert!(out.status.success(), "{name}: {}", text(&out));
        // Quiet success: the embedded cluster removing its own groups and actors is not reported as deaths.
        let said = text(&out);
        assert!(!said.contains("ActorDied"), "{name}: {said}");
        assert!(!said.contains(" WARN "), "{name}: {said}");
        metrics(&d.join(name))
    };
    let one = run("w1", 4, &[]);
    let two = run("w2", 4, &["--nproc-per-node", "2"]);
    assert_same_steps("FULL_SHARD on 2 ranks", &one, &two, 1e-5);
    let hsdp = [
        "--nproc-per-node",
        "4",
        "actor_rollout_ref.actor.fsdp_config.fsdp_size=2",
    ];
    let four = run("w4", 4, &hsdp);
    assert_same_steps("HSDP on 4 ranks (2 shard groups of 2)", &one, &four, 1e-5);
    // Two steps on 2 ranks, then the rest in one process from their checkpoint, and the reverse.
    run("r21", 2, &["--nproc-per-node", "2"]);
    let r21 = run("r21", 4, &[]);
    assert_same_steps("2 ranks resumed in 1 process", &one, &r21, 1e-5);
    run("r12", 2, &[]);
    let r12 = run("r12", 4, &["--nproc-per-node", "2"]);
    assert_same_steps("1 process resumed on 2 ranks", &one, &r12, 1e-5);
}

/// `ferl grpo --address` on a cluster started with `ferl start` (a head and a node on loopback, one CPU each;
/// `--nnodes 2`: one trainer-rank actor on each): its steps equal one process within 1e-5, and its checkpoints
/// resume in one process, and the reverse; `ferl status` shows the finished GRPO job.
#[test]
fn grpo_on_a_ferl_start_cluster_equals_one_process_and_resumes_across_paths() {
    let dir = fixture();
    let d = dir.path();
    let shape = [
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=1",
    ];
    let in_process_with = |name: &str, steps: usize, extra: &[&str]| {
        let out = run_ferl(&grpo_args(d, name, steps, &[&shape[..], extra].concat()));
        assert!(out.status.success(), "{name}: {}", text(&out));
        metrics(&d.join(name))
    };
    let in_process = |name: &str, steps: usize| in_process_with(name, steps, &[]);
    let cluster = LoopbackCluster::start(&[1, 1]);
    let on_cluster_with = |name: &str, steps: usize, extra: &[&str]| {
        let mut args = grpo_args(d, name, steps, &[&shape[..], extra].concat());
        let flags = ["--address", &cluster.address, "--nproc-per-node", "1"];
        args.extend(
            flags
                .iter()
                .chain(&["--nnodes", "2"])
                .map(|s| s.to_string()),
        );
        let out = cluster
            .command()
            .env("OMP_NUM_THREADS", "1")
            .args(&args)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{name} on the cluster: {}",
            text(&out)
        );
        metrics(&d.join(name))
    };
    let on_cluster = |name: &str, steps: usize| on_cluster_with(name, steps, &[]);
    let one = in_process("w1", 4);
    let two = on_cluster("cluster", 4);
    assert_same_steps("2 trainer-rank actors on 2 nodes", &one, &two, 1e-5);
    // Ulysses across the two nodes' ranks, and LoRA, as on every other path.
    let sp = ["actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"];
    let cluster_sp = on_cluster_with("cluster_sp", 4, &sp);
    assert_same_steps("Ulysses 2 over 2 nodes", &one, &cluster_sp, 1e-5);
    // (A learning rate that keeps the second mini-batch's ratios near their clip range: at 2e-2 the clipping
    // amplifies float noise, and runs on different thread counts part after two steps.)
    let lora = [
        "actor_rollout_ref.model.lora_rank=4",
        "actor_rollout_ref.actor.optim.lr=2e-3",
    ];
    let one_lora = in_process_with("w1_lora", 4, &lora);
    let cluster_lora = on_cluster_with("cluster_lora", 4, &lora);
    assert_same_steps("LoRA on 2 nodes", &one_lora, &cluster_lora, 1e-5);
    let status = cluster.status();
    let job = status["jobs"]
        .as_array()
        .and_then(|j| j.first())
        .unwrap_or_else(|| panic!("no job in `ferl status`: {status:#}"));
    assert_eq!(
        (&job["kind"], &job["state"], &job["world_size"]),
        (&"grpo".into(), &"finished".into(), &2.into()),
        "{job:#}"
    );
    on_cluster("c1", 2);
    let c1 = in_process("c1", 4);
    assert_same_steps(
        "the cluster's checkpoint resumed in 1 process",
        &one,
        &c1,
        1e-5,
    );
    in_process("1c", 2);
    let one_c = on_cluster("1c", 4);
    assert_same_steps(
        "1 process's checkpoint resumed on the cluster",
        &one,
        &one_c,
        1e-5,
    );
}

/// The processes whose stdout is a trainer-rank worker's log (`*_TrainerRank.log`) and for which `pick(pid, log)`
/// holds.
fn trainer_rank_workers(pick: impl Fn(u32, &Path) -> bool) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&pid| {
            std::fs::read_link(format!("/proc/{pid}/fd/1"))
                .is_ok_and(|p| p.to_string_lossy().ends_with("_TrainerRank.log") && pick(pid, &p))
        })
        .collect()
}

/// The trainer-rank workers whose logs are under `dir` (a cluster's session folder).
fn trainer_rank_workers_under(dir: &Path) -> Vec<u32> {
    trainer_rank_workers(|_, log| log.starts_with(dir))
}

/// The trainer-rank workers `pid` started (the node of its embedded cluster runs in it).
fn trainer_rank_workers_of(pid: u32) -> Vec<u32> {
    let parent = |p: u32| {
        let stat = std::fs::read_to_string(format!("/proc/{p}/stat")).unwrap_or_default();
        // `pid (comm) state ppid ...`: the fields after the command's closing parenthesis.
        let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
        rest.split_whitespace().nth(1)?.parse::<u32>().ok()
    };
    trainer_rank_workers(|p, _| parent(p) == Some(pid))
}

/// `trainer.max_restarts=1` on the cluster path: a trainer-rank actor SIGKILLed after step 3 of 6 is replaced and
/// the run goes on as if uninterrupted, within 1e-5: from its step-3 checkpoint (`save_freq=1`: steps 4-6 equal), and
/// without one (`save_freq=-1`: every step again, sampling as the first attempt did).
#[test]
fn a_killed_rank_actor_on_the_cluster_restarts_and_the_run_continues_as_if_uninterrupted() {
    let dir = fixture();
    let d = dir.path();
    let shape = ["actor_rollout_ref.rollout.n=4"];
    let clean = run_ferl(&grpo_args(d, "clean", 6, &shape));
    assert!(clean.status.success(), "{}", text(&clean));
    let clean = metrics(&d.join("clean"));
    let cluster = LoopbackCluster::start(&[2]);
    for (name, save_freq, from) in [
        ("ckpt", "trainer.save_freq=1", 4),
        ("none", "trainer.save_freq=-1", 1),
    ] {
        let extra = [&shape[..], &["trainer.max_restarts=1", save_freq]].concat();
        let mut args = grpo_args(d, name, 6, &extra);
        args.extend(["--address", &cluster.address, "--nproc-per-node", "2"].map(String::from));
        let out = run_killing_a_rank(&cluster, &args, &d.join(name));
        let lines = metrics(&d.join(name));
        let restarts = lines.iter().filter_map(|l| l["system/restarts"].as_f64());
        assert_eq!(restarts.fold(0.0, f64::max), 1.0, "{name}: {}", text(&out));
        assert_same_steps(
            &format!("{name}: steps {from}-6 after the restart"),
            &clean[from as usize - 1..],
            &last_lines_of(&lines, from..=6),
            1e-5,
        );
    }
}

/// Runs the driver `ferl args` on `cluster`, SIGKILLs one of its trainer-rank workers once `run` logged step 3, and
/// returns what the driver did (it must succeed).
fn run_killing_a_rank(
    cluster: &LoopbackCluster,
    args: &[String],
    run: &Path,
) -> std::process::Output {
    let driver = cluster
        .command()
        .env("OMP_NUM_THREADS", "1")
        .args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let started = std::time::Instant::now();
    while metrics_lines(run) < 3 {
        assert!(started.elapsed().as_secs() < 300, "no step 3 in 5 minutes");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let ranks = trainer_rank_workers_under(cluster.dir.path());
    assert_eq!(ranks.len(), 2, "the cluster's trainer ranks: {ranks:?}");
    // SAFETY: kill has no memory preconditions.
    assert_eq!(unsafe { libc::kill(ranks[1] as i32, libc::SIGKILL) }, 0);
    let out = driver.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", text(&out));
    out
}

/// The last line `lines` logged for each of `steps` (a restarted run logs the steps after its checkpoint again).
fn last_lines_of(lines: &[Value], steps: std::ops::RangeInclusive<u64>) -> Vec<Value> {
    let last_of = |step: u64| {
        lines
            .iter()
            .rev()
            .find(|l| l["step"].as_u64() == Some(step))
            .cloned()
            .unwrap_or_else(|| panic!("no step {step} in {lines:?}"))
    };
    steps.map(last_of).collect()
}

/// Lines `metrics.jsonl` under `run` holds (0 before it exists).
fn metrics_lines(run: &Path) -> usize {
    std::fs::read_to_string(run.join("metrics.jsonl")).map_or(0, |t| t.lines().count())
}

/// How the RL forwards (old and reference log-probabilities, the update) cut and lay out their rows, in one process
/// and on 2 ranks:
/// - `actor_rollout_ref.model.use_remove_padding=true` packs each micro-batch's rows into one row without padding
///   (the GSM8K prompts differ in length, so the padded forwards hold padding the packed ones drop);
/// - `actor_rollout_ref.actor.use_dynamic_bsz=true` cuts them under `ppo_max_token_len_per_gpu` tokens (the
///   rollout's and the reference's budgets follow it), every rank into as many micro-batches.
///
/// Each equals the run of fixed, padded micro-batches within 1e-5; a budget that cannot hold one row is refused by
/// its key before anything runs.
#[test]
fn remove_padding_and_dynamic_bsz_cut_the_rl_forwards_with_the_fixed_runs_results() {
    let dir = fixture();
    let d = dir.path();
    let shape = [
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    ];
    let run = |name: &str, extra: &[&str]| {
        let out = run_ferl(&grpo_args(d, name, 3, &[&shape[..], extra].concat()));
        assert!(out.status.success(), "{name}: {}", text(&out));
        metrics(&d.join(name))
    };
    let fixed = run("fixed", &[]);
    let packed = ["actor_rollout_ref.model.use_remove_padding=true"];
    let two = ["--nproc-per-node", "2"];
    let dynamic = [
        "actor_rollout_ref.actor.use_dynamic_bsz=true",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=600",
    ];
    let cases: [(&str, Vec<&str>); 4] = [
        ("packed in 1 process", packed.to_vec()),
        ("packed on 2 ranks", [&packed[..], &two].concat()),
        (
            "token budgets in 1 process, packed",
            [&packed[..], &dynamic].concat(),
        ),
        (
            "token budgets on 2 ranks, padded",
            [&dynamic[..], &two].concat(),
        ),
    ];
    for (i, (what, extra)) in cases.iter().enumerate() {
        let got = run(&format!("case{i}"), extra);
        assert_same_steps(what, &fixed, &got, 1e-5);
    }
    let small = [
        "actor_rollout_ref.actor.use_dynamic_bsz=true",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=100",
    ];
    let out = run_ferl(&grpo_args(d, "small", 3, &small));
    assert!(!out.status.success(), "{}", text(&out));
    let key =
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=100: a micro-batch must hold one row";
    assert!(text(&out).contains(key), "{}", text(&out));
    assert!(!d.join("small").exists(), "a refused run left its folder");
}

/// A GRPO run leaves `curves.png` in its folder and says where, with only the console logger too (the picture is
/// drawn from the steps it logged).
#[test]
fn a_grpo_run_leaves_its_curves_with_only_the_console_logger() {
    let dir = fixture();
    let d = dir.path();
    let out = run_ferl(&grpo_args(d, "pic", 2, &["trainer.logger=[console]"]));
    assert!(out.status.success(), "{}", text(&out));
    assert!(!d.join("pic/metrics.jsonl").exists());
    let curves = d.join("pic/curves.png");
    let bytes = std::fs::read(&curves).unwrap();
    assert!(
        bytes.starts_with(b"\x89PNG") && bytes.len() > 15_000,
        "{} bytes",
        bytes.len()
    );
    let said = format!("curves: {}", curves.display());
    assert!(text(&out).contains(&said), "{}", text(&out));
}

#[test]
fn grpo_under_torchrun_equals_one_process() {
    let Some(torchrun) = torchrun() else { return };
    let dir = fixture();
    let d = dir.path();
    let shape = [
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=1",
    ];
    let one = run_ferl(&grpo_args(d, "w1", 3, &shape));
    assert!(one.status.success(), "{}", text(&one));
    let out = run_under_torchrun(&torchrun, 2, &grpo_args(d, "torchrun", 3, &shape));
    assert!(out.status.success(), "{}", text(&out));
    assert_same_steps(
        "2 ranks under torchrun",
        &metrics(&d.join("w1")),
        &metrics(&d.join("torchrun")),
        1e-5,
    );
}

/// Starts `ferl args` and returns it once `run` logged `lines` steps.
fn launch_until_logged(args: &[String], run: &Path, lines: usize) -> std::process::Child {
    let driver = Command::new(ferl_binary())
        .env("OMP_NUM_THREADS", "1")
        .args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let started = std::time::Instant::now();
    while metrics_lines(run) < lines {
        assert!(
            started.elapsed().as_secs() < 300,
            "no step {lines} in 5 minutes"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    driver
}

/// `--nproc-per-node 2` (an embedded cluster) with `trainer.max_restarts=1`: a trainer-rank worker SIGKILLed after
/// step 3 of 6 is replaced, and steps 4-6 equal an uninterrupted run's within 1e-5.
#[test]
fn a_killed_rank_restarts_and_the_run_continues_as_if_uninterrupted() {
    let dir = fixture();
    let d = dir.path();
    let shape = ["actor_rollout_ref.rollout.n=4", "--nproc-per-node", "2"];
    let clean = run_ferl(&grpo_args(d, "clean", 6, &shape));
    assert!(clean.status.success(), "{}", text(&clean));
    let restarts = [&shape[..], &["trainer.max_restarts=1"]].concat();
    let args = grpo_args(d, "killed", 6, &restarts);
    let driver = launch_until_logged(&args, &d.join("killed"), 3);
    let ranks = trainer_rank_workers_of(driver.id());
    assert_eq!(ranks.len(), 2, "the driver's trainer ranks: {ranks:?}");
    // SAFETY: kill has no memory preconditions.
    assert_eq!(unsafe { libc::kill(ranks[1] as i32, libc::SIGKILL) }, 0);
    let out = driver.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let lines = metrics(&d.join("killed"));
    let restarts = lines.iter().filter_map(|l| l["system/restarts"].as_f64());
    assert_eq!(restarts.fold(0.0, f64::max), 1.0, "{}", text(&out));
    assert_same_steps(
        "steps 4-6 after the restart",
        &metrics(&d.join("clean"))[3..],
        &last_lines_of(&lines, 4..=6),
        1e-5,
    );
}

/// The trainer ranks of `--nproc-per-node` do not outlive their killed driver.
#[test]
fn the_ranks_die_with_a_killed_driver() {
    let dir = fixture();
    let d = dir.path();
    let shape = ["actor_rollout_ref.rollout.n=4", "--nproc-per-node", "2"];
    let args = grpo_args(d, "orphans", 1000, &shape);
    let mut driver = launch_until_logged(&args, &d.join("orphans"), 1);
    let ranks = trainer_rank_workers_of(driver.id());
    assert_eq!(ranks.len(), 2, "the driver's trainer ranks: {ranks:?}");
    driver.kill().unwrap();
    driver.wait().unwrap();
    let alive = |pid: u32| {
        // A zombie (state Z) has exited; only its exit status is left to reap.
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .is_ok_and(|s| s.split_whitespace().nth(2).is_none_or(|state| state != "Z"))
    };
    let killed = std::time::Instant::now();
    while ranks.iter().any(|&p| alive(p)) {
        assert!(
            killed.elapsed().as_secs() < 10,
            "ranks {ranks:?} outlived their killed driver by 10 s"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

#[test]
fn grpo_scores_with_the_reward_plugin_of_custom_reward_function_path() {
    let dir = fixture();
    let d = dir.path();
    let plugin = plugin_file("ferl_plugin_gsm8k");
    let path = format!("custom_reward_function.path={}", plugin.display());
    let out = run_ferl(&grpo_args(
        d,
        "c",
        1,
        &[&path, "custom_reward_function.name=gsm8k"],
    ));
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(number(&metrics(&d.join("c"))[0], "critic/score/mean"), 0.0);
    let wrong = run_ferl(&grpo_args(
        d,
        "c2",
        1,
        &[&path, "custom_reward_function.name=other"],
    ));
    assert!(!wrong.status.success());
    assert!(
        text(&wrong).contains("holds reward plugin `gsm8k`"),
        "{}",
        text(&wrong)
    );
}

/// The first-party plugin library `name` that the workspace build left beside the `ferl` binary.
fn plugin_file(name: &str) -> PathBuf {
    let file = ferl_binary().with_file_name(format!("lib{name}.so"));
    assert!(
        file.exists(),
        "{} is built with the workspace",
        file.display()
    );
    file
}

#[test]
fn grpo_refuses_what_it_cannot_honour_by_key() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let cases: [(&str, &str); 6] = [
        (
            "actor_rollout_ref.rollout.tensor_model_parallel_size=4",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=4: `4` not supported by ferl yet (supported: 1)",
        ),
        (
            "actor_rollout_ref.rollout.name=vllm",
            "actor_rollout_ref.rollout.name",
        ),
        ("algorithm.adv_estimator=gae", "algorithm.adv_estimator"),
        ("data.val_files=x.parquet", "data.val_files"),
        (
            "reward_model.reward_manager=prime",
            "reward_model.reward_manager",
        ),
        (
            "actor_rollout_ref.actor.lr=1e-5",
            "actor_rollout_ref.actor.optim.lr",
        ),
    ];
    for (arg, named) in cases {
        let out = run_ferl(&grpo_args(d, "r", 1, &[arg]));
        assert!(!out.status.success(), "{arg} was accepted");
        assert!(
            text(&out).contains(named),
            "{arg}: the error does not name {named}:\n{}",
            text(&out)
        );
    }
}

/// One `ferl sft` step (lr 1e-2, so the weights visibly move) saved under `d/sft`.
fn sft_checkpoint(d: &Path) -> PathBuf {
    let args: Vec<String> = [
        "sft".to_string(),
        format!("model.partial_pretrain={}", d.join("model").display()),
        format!(
            "data.train_files={}",
            d.join("data/train.parquet").display()
        ),
        "data.val_files=[]".into(),
        "data.prompt_key=extra_info".into(),
        "data.response_key=extra_info".into(),
        "data.prompt_dict_keys=[question]".into(),
        "data.response_dict_keys=[answer]".into(),
        "data.train_batch_size=2".into(),
        "data.micro_batch_size_per_gpu=2".into(),
        "data.max_length=96".into(),
        "data.truncation=right".into(),
        "optim.lr=1e-2".into(),
        "trainer.total_training_steps=1".into(),
        format!("trainer.default_local_dir={}", d.join("sft").display()),
        "trainer.device=cpu".into(),
        "trainer.logger=[console]".into(),
    ]
    .into();
    let out = run_ferl(&args);
    assert!(out.status.success(), "{}", text(&out));
    d.join("sft/global_step_1")
}

#[test]
fn grpo_starts_from_an_sft_checkpoint() {
    let dir = fixture();
    let d = dir.path();
    let ckpt = sft_checkpoint(d);
    let from = format!("actor_rollout_ref.model.path={}", ckpt.display());
    let tok = format!("data.tokenizer={}", d.join("model").display());
    let out = run_ferl(&grpo_args(d, "from_sft", 1, &[&from, &tok]));
    assert!(out.status.success(), "{}", text(&out));
    let base = run_ferl(&grpo_args(d, "from_base", 1, &[]));
    assert!(base.status.success(), "{}", text(&base));
    let (sft, hf) = (metrics(&d.join("from_sft")), metrics(&d.join("from_base")));
    let (a, b) = (
        number(&sft[0], "actor/entropy"),
        number(&hf[0], "actor/entropy"),
    );
    assert!(
        (a - b).abs() > 1e-4,
        "the SFT step's weights were used: entropy {a} vs the base model's {b}"
    );
    let no_tok = run_ferl(&grpo_args(d, "no_tok", 1, &[&from]));
    assert!(!no_tok.status.success());
    assert!(
        text(&no_tok).contains("set data.tokenizer"),
        "{}",
        text(&no_tok)
    );
}
