//! `ferl generate` (verl's `main_generation`) on verl's GSM8K parquet: the output keeps every input column and adds
//! `responses`, `--n-samples` texts per row equal to what `ferl_trainer::rollout` generates for the chat-templated
//! prompts (batches of `--batch-size`, batch k seeded with `--seed + k`) and decoded with special tokens skipped, as
//! verl does; the same command writes the same file, and impossible arguments or a missing prompt column are refused
//! by name.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Output};

use ferl_data::SftTokenizer;
use ferl_tests::*;
use ferl_trainer::rollout::{GenerationConfig, RolloutModel, SamplingParams};
use serde_json::Value;

fn run_ferl(args: &[&str]) -> Output {
    Command::new(ferl_binary())
        .env("OMP_NUM_THREADS", "1")
        .args(args)
        .output()
        .expect("run ferl")
}

/// What the library generates for `rows` with the command's settings below (seed 5, batches of 4, 2 samples).
fn library_responses(model_dir: &Path, rows: &[Value]) -> Vec<Vec<String>> {
    let tok = SftTokenizer::from_dir(model_dir, None).unwrap();
    let prompts: Vec<Vec<i64>> = rows
        .iter()
        .flat_map(|r| {
            let messages = r["prompt"].as_array().unwrap();
            let text = tok
                .template()
                .unwrap()
                .render(messages, true, None, &BTreeMap::new())
                .unwrap();
            let ids = tok.encode(&text).unwrap();
            [ids.clone(), ids]
        })
        .collect();
    let model = RolloutModel::load(model_dir, tch::Device::Cpu, tch::Kind::Float).unwrap();
    let sampling = SamplingParams {
        top_k: 50,
        ..SamplingParams::sample(0.9, 5)
    };
    let mut config = GenerationConfig::from_model_dir(model_dir, 12, sampling).unwrap();
    config.eos_token_ids.push(tok.eos_token_id());
    config.pad_token_id = tok.pad_token_id();
    let mut texts = Vec::new();
    for (k, batch) in prompts.chunks(4).enumerate() {
        config.sampling.seed = 5 + k as u64;
        for g in model.generate(batch, &config).unwrap() {
            texts.push(tok.decode_skip_special(&g.response).unwrap());
        }
    }
    texts.chunks(2).map(<[String]>::to_vec).collect()
}

#[test]
fn ferl_generate_writes_what_the_rollout_library_generates() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let model = d.join("model");
    write_tiny_model(&model).unwrap();
    std::fs::create_dir_all(d.join("raw")).unwrap();
    write_gsm8k_slice(&d.join("raw/train.jsonl"), 2).unwrap();
    write_gsm8k_slice(&d.join("raw/test.jsonl"), 3).unwrap();
    let s = |p: &Path| p.to_str().unwrap().to_string();
    let out = run_ferl(&[
        "data",
        "gsm8k",
        "--input-dir",
        &s(&d.join("raw")),
        "--local-dir",
        &s(&d.join("data")),
    ]);
    assert_success(&out, "ferl data gsm8k");
    let input = d.join("data/test.parquet");
    let generate = |output: &Path, seed: &str| {
        let args = [
            "generate",
            "--model",
            &s(&model),
            "--input",
            &s(&input),
            "--output",
            &s(output),
            "--n-samples",
            "2",
            "--do-sample",
            "--temperature",
            "0.9",
            "--top-k",
            "50",
            "--seed",
            seed,
            "--response-length",
            "12",
            "--batch-size",
            "4",
        ];
        let out = run_ferl(&args);
        assert_success(&out, "ferl generate");
        ferl_data::read::read_rows(output, None).unwrap()
    };
    let rows = generate(&d.join("out.parquet"), "5");
    let inputs = ferl_data::read::read_rows(&input, None).unwrap();
    assert_eq!(rows.len(), 3);
    for (r, i) in rows.iter().zip(&inputs) {
        for (k, v) in i.as_object().unwrap() {
            assert_eq!(&r[k], v, "input column `{k}` is kept");
        }
    }
    let responses: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            r["responses"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_str().unwrap().to_string())
                .collect()
        })
        .collect();
    assert!(responses
        .iter()
        .all(|r| r.len() == 2 && r.iter().all(|t| !t.is_empty())));
    assert_eq!(responses, library_responses(&model, &inputs));
    assert_eq!(
        generate(&d.join("again.parquet"), "5"),
        rows,
        "the same command writes the same rows"
    );
    assert_ne!(
        generate(&d.join("other.parquet"), "6"),
        rows,
        "another seed samples other responses"
    );
}

#[test]
fn ferl_generate_refuses_greedy_samples_and_a_missing_prompt_column() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let model = d.join("model");
    write_tiny_model(&model).unwrap();
    let input = d.join("prompts.jsonl");
    std::fs::write(&input, "{\"question\": \"1 + 1?\"}\n").unwrap();
    let (m, i, o) = (
        model.to_str().unwrap(),
        input.to_str().unwrap(),
        d.join("out.parquet"),
    );
    let o = o.to_str().unwrap();
    let out = run_ferl(&[
        "generate",
        "--model",
        m,
        "--input",
        i,
        "--output",
        o,
        "--n-samples",
        "2",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("--do-sample"),
        "{err}"
    );
    let out = run_ferl(&["generate", "--model", m, "--input", i, "--output", o]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("row 0") && err.contains("`prompt`"),
        "{err}"
    );
    // A plain string prompt is one user message.
    let out = run_ferl(&[
        "generate",
        "--model",
        m,
        "--input",
        i,
        "--output",
        o,
        "--prompt-key",
        "question",
        "--response-length",
        "4",
    ]);
    assert_success(&out, "ferl generate --prompt-key question");
    let rows = ferl_data::read::read_rows(Path::new(o), None).unwrap();
    assert_eq!(rows[0]["responses"].as_array().map(Vec::len), Some(1));
}
