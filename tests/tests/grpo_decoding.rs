//! Responses as verl decodes them (issue 31): `tokenizer.decode(ids, skip_special_tokens=True)`, so a response that
//! stops at the EOS token `<|im_end|>` reaches a reward, and `ferl generate`'s `responses` column, without it.
//!
//! The model is the tiny Qwen2 rigged to answer every prompt with `4` and then stop: its attention and MLP outputs
//! are zeroed (the residual stream is the current token's embedding), the last prompt token's embedding points along
//! one axis and `4`'s along another, and the untied head maps the first axis to `4` and the second to EOS with
//! logits of about 113 against 0 for every other token. So greedy and sampled responses alike are the tokens
//! `[4, <|im_end|>]`, whose text with special tokens kept would be `4<|im_end|>`.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use ferl_data::SftTokenizer;
use ferl_tests::rl::template_reward;
use ferl_tests::*;
use serde_json::Value;
use tch::{Kind, Tensor};

/// The one user message of every prompt.
const QUESTION: &str = "What is two plus two?";
/// What the rigged model answers.
const ANSWER: &str = "4";

fn run_ferl(args: &[String]) -> Output {
    Command::new(ferl_binary())
        .env("OMP_NUM_THREADS", "1")
        .env_remove("FERL_PLUGIN_PATH")
        .args(args)
        .output()
        .expect("run ferl")
}

/// The messages of [`QUESTION`].
fn messages() -> Value {
    serde_json::json!([{"role": "user", "content": QUESTION}])
}

/// Sets row `row` of the `[rows, width]` matrix `m` to `value` at column `col` and 0 elsewhere.
fn set_row(m: &mut Tensor, row: i64, col: i64, value: f64) {
    let width = m.size()[1];
    let mut r = m.get(row);
    let v = Tensor::zeros([width], (Kind::Float, tch::Device::Cpu));
    let _ = v.get(col).fill_(value);
    r.copy_(&v);
}

/// Writes the rigged model (see the module docs) into `dir`; returns the tokenizer and the answer's token id.
fn rigged_model(dir: &Path) -> (SftTokenizer, i64) {
    write_tiny_model(dir).unwrap();
    let tok = SftTokenizer::from_dir(dir, None).unwrap();
    let prompt = tok
        .template()
        .unwrap()
        .render(
            messages().as_array().unwrap(),
            true,
            None,
            &Default::default(),
        )
        .unwrap();
    let last = *tok.encode(&prompt).unwrap().last().unwrap();
    let answer = tok.encode(ANSWER).unwrap();
    assert_eq!(answer.len(), 1, "`{ANSWER}` is one token");
    let (answer, eos) = (answer[0], tok.eos_token_id());

    let file = dir.join("model.safetensors");
    let mut tensors = Tensor::read_safetensors(&file).unwrap();
    let mut head = None;
    for (name, t) in tensors.iter_mut() {
        if name.ends_with("o_proj.weight") || name.ends_with("down_proj.weight") {
            let _ = t.zero_();
        } else if name == "model.norm.weight" {
            let _ = t.fill_(1.0);
        } else if name == "model.embed_tokens.weight" {
            set_row(t, last, 0, 4.0);
            set_row(t, answer, 1, 4.0);
            let mut h = t.zeros_like();
            set_row(&mut h, answer, 0, 20.0);
            set_row(&mut h, eos, 1, 20.0);
            head = Some(h);
        }
    }
    tensors.push(("lm_head.weight".into(), head.expect("an embedding matrix")));
    Tensor::write_safetensors(&tensors, &file).unwrap();
    let cfg_file = dir.join("config.json");
    let mut cfg: Value = serde_json::from_slice(&std::fs::read(&cfg_file).unwrap()).unwrap();
    cfg["tie_word_embeddings"] = false.into();
    std::fs::write(&cfg_file, serde_json::to_vec_pretty(&cfg).unwrap()).unwrap();
    (tok, answer)
}

/// `rows` prompts of [`QUESTION`] in verl's RL layout, with ground truth [`ANSWER`], as JSON lines in `file`.
fn write_prompts(file: &Path, rows: usize) {
    let row = serde_json::json!({
        "prompt": messages(),
        "data_source": "rigged",
        "reward_model": {"ground_truth": ANSWER},
    });
    std::fs::write(file, format!("{row}\n").repeat(rows)).unwrap();
}

#[test]
fn ferl_generate_writes_responses_without_special_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (tok, answer) = rigged_model(&d.join("model"));
    assert_eq!(
        tok.decode(&[answer, tok.eos_token_id()]).unwrap(),
        format!("{ANSWER}<|im_end|>"),
        "kept, the EOS would show"
    );
    write_prompts(&d.join("prompts.jsonl"), 2);
    let s = |p: PathBuf| p.display().to_string();
    let mut args: Vec<String> = ["generate", "--model"].map(String::from).into();
    args.extend([
        s(d.join("model")),
        "--input".into(),
        s(d.join("prompts.jsonl")),
        "--response-length".into(),
        "6".into(),
    ]);
    let greedy = [
        args.clone(),
        vec!["--output".into(), s(d.join("g.parquet"))],
    ]
    .concat();
    assert_success(&run_ferl(&greedy), "ferl generate (greedy)");
    let sampled = [
        args,
        [
            "--output",
            &s(d.join("s.parquet")),
            "--do-sample",
            "--n-samples",
            "2",
        ]
        .map(String::from)
        .into(),
    ]
    .concat();
    assert_success(&run_ferl(&sampled), "ferl generate (sampled)");
    for (file, n) in [("g.parquet", 1), ("s.parquet", 2)] {
        let rows = ferl_data::read::read_rows(&d.join(file), None).unwrap();
        assert_eq!(rows.len(), 2);
        for row in rows {
            assert_eq!(
                row["responses"],
                Value::from(vec![ANSWER; n]),
                "{file}: the response `{ANSWER}` then EOS, decoded with special tokens skipped"
            );
        }
    }
}

#[test]
fn an_exact_match_reward_scores_a_response_that_ends_at_eos_as_a_match() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    rigged_model(&d.join("model"));
    write_prompts(&d.join("train.jsonl"), 2);
    let run = d.join("run");
    let args: Vec<String> = vec![
        "grpo".into(),
        format!("data.train_files={}", d.join("train.jsonl").display()),
        format!("actor_rollout_ref.model.path={}", d.join("model").display()),
        format!("trainer.default_local_dir={}", run.display()),
        format!(
            "custom_reward_function.path={}",
            template_reward().display()
        ),
        "custom_reward_function.name=template-reward".into(),
        "data.train_batch_size=2".into(),
        "data.max_prompt_length=64".into(),
        "data.max_response_length=4".into(),
        "actor_rollout_ref.rollout.n=2".into(),
        "actor_rollout_ref.actor.ppo_mini_batch_size=2".into(),
        "actor_rollout_ref.model.enable_gradient_checkpointing=false".into(),
        "algorithm.adv_estimator=grpo".into(),
        "trainer.logger=[console,jsonl]".into(),
        "trainer.device=cpu".into(),
        "trainer.total_training_steps=1".into(),
        format!("trainer.rollout_data_dir={}", d.join("dumps").display()),
    ];
    assert_success(&run_ferl(&args), "ferl grpo");
    // verl's rollout dump: one line per row, texts decoded as the reward saw them; 2 ranks dump the same rows.
    let dump = assert_rollout_dump(&d.join("dumps"));
    let on_two = [
        &args[..],
        &[
            format!("trainer.default_local_dir={}", d.join("run2").display()),
            format!("trainer.rollout_data_dir={}", d.join("dumps2").display()),
            "--nproc-per-node".into(),
            "2".into(),
        ],
    ]
    .concat();
    assert_success(&run_ferl(&on_two), "ferl grpo --nproc-per-node 2");
    assert_eq!(assert_rollout_dump(&d.join("dumps2")), dump);
    let text = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    let line: Value = serde_json::from_str(text.lines().next().unwrap()).unwrap();
    let metric = |key: &str| {
        line[key]
            .as_f64()
            .unwrap_or_else(|| panic!("{key}: {line}"))
    };
    assert_eq!(
        metric("response_length/mean"),
        2.0,
        "every response is `{ANSWER}` then EOS: {line}"
    );
    assert_eq!(
        metric("critic/score/mean"),
        1.0,
        "each response matches its ground truth once EOS is skipped: {line}"
    );
}

/// Checks `dir/1.jsonl`, the rollout dump of the rigged run's one step (2 prompts × 2 responses): verl's keys, the
/// prompt and the response decoded without special tokens, each response scored 1. Returns its lines.
fn assert_rollout_dump(dir: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(dir.join("1.jsonl")).unwrap();
    let lines: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 4, "{text}");
    for line in &lines {
        assert_eq!(
            (&line["output"], &line["gts"], &line["score"], &line["step"]),
            (&ANSWER.into(), &ANSWER.into(), &1.0.into(), &1.into()),
            "{line}"
        );
        let input = line["input"].as_str().unwrap();
        assert!(input.contains(QUESTION), "{line}");
        assert!(
            !input.contains("<|im_start|>"),
            "special tokens skipped: {line}"
        );
    }
    lines
}
