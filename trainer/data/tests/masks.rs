//! Loss masks on real GSM8K rows with the real Qwen tokenizer, nested keys, truncation and error locations.

mod common;

use std::path::{Path, PathBuf};

use ferl_config::{SftConfig, Truncation};
use ferl_data::gsm8k::{gsm8k_batch, write_parquet, INSTRUCTION};
use ferl_data::read::read_rows;
use ferl_data::{SftDataset, SftTokenizer};
use serde_json::json;

/// The first `n` GSM8K train rows prepared as verl parquet in `dir`.
fn gsm8k_parquet(dir: &Path, n: usize) -> PathBuf {
    let mut rows = read_rows(&common::gsm8k_raw().join("train.jsonl"), None).unwrap();
    rows.truncate(n);
    let path = dir.join("train.parquet");
    write_parquet(&gsm8k_batch(&rows, "train", "train.jsonl").unwrap(), &path).unwrap();
    path
}

fn config(overrides: &[&str]) -> SftConfig {
    let o: Vec<String> = overrides.iter().map(|s| s.to_string()).collect();
    SftConfig::load(None, &o).unwrap()
}

#[test]
fn single_turn_mask_on_real_gsm8k_rows() {
    let dir = tempfile::tempdir().unwrap();
    let file = gsm8k_parquet(dir.path(), 20);
    let cfg = config(&["data.prompt_key=question", "data.response_key=answer"]);
    let ds = SftDataset::load(
        &cfg.data,
        &common::qwen_tokenizer(),
        std::slice::from_ref(&file),
    )
    .unwrap();
    let tok = SftTokenizer::from_dir(&common::qwen_tokenizer(), None).unwrap();
    assert_eq!(ds.len(), 20);
    assert_eq!(ds.eos_token_id(), 151645, "<|im_end|>");
    assert_eq!(ds.pad_token_id(), 151643, "<|endoftext|>");
    let rows = read_rows(&file, None).unwrap();
    for (i, row) in rows.iter().enumerate() {
        let s = ds.get(i);
        let prompt_text = format!(
            "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n",
            row["question"].as_str().unwrap()
        );
        let prompt = tok.encode(&prompt_text).unwrap();
        let response = tok.encode(row["answer"].as_str().unwrap()).unwrap();
        assert_eq!(s.len(), prompt.len() + response.len() + 1, "row {i}");
        assert_eq!(&s.input_ids[..prompt.len()], &prompt[..], "row {i}");
        assert_eq!(
            &s.input_ids[prompt.len()..s.len() - 1],
            &response[..],
            "row {i}"
        );
        assert_eq!(
            *s.input_ids.last().unwrap(),
            151645,
            "row {i} ends with EOS"
        );
        assert!(
            s.loss_mask[..prompt.len()].iter().all(|&m| !m),
            "row {i}: no prompt token is a target"
        );
        assert!(
            s.loss_mask[prompt.len()..].iter().all(|&m| m),
            "row {i}: every response token and EOS are targets"
        );
        assert_eq!(s.num_targets(), response.len() + 1);
    }
}

#[test]
fn nested_dict_keys_give_the_same_samples_as_flat_columns() {
    let dir = tempfile::tempdir().unwrap();
    let file = gsm8k_parquet(dir.path(), 8);
    let flat = config(&["data.prompt_key=question", "data.response_key=answer"]);
    let nested = config(&[
        "data.prompt_key=extra_info",
        "data.response_key=extra_info",
        "data.prompt_dict_keys=['question']",
        "+data.response_dict_keys=['answer']",
    ]);
    let a = SftDataset::load(
        &flat.data,
        &common::qwen_tokenizer(),
        std::slice::from_ref(&file),
    )
    .unwrap();
    let b = SftDataset::load(
        &nested.data,
        &common::qwen_tokenizer(),
        std::slice::from_ref(&file),
    )
    .unwrap();
    assert_eq!(a.samples(), b.samples());
    // verl's `prompt` column (chat messages with the instruction) is used as the conversation itself.
    let msgs = config(&["data.prompt_key=prompt", "data.response_key=answer"]);
    let c = SftDataset::load(&msgs.data, &common::qwen_tokenizer(), &[file]).unwrap();
    let tok = SftTokenizer::from_dir(&common::qwen_tokenizer(), None).unwrap();
    let s = c.get(0);
    let n_prompt = s.loss_mask.iter().position(|&m| m).unwrap();
    assert!(tok
        .decode(&s.input_ids[..n_prompt])
        .unwrap()
        .contains(INSTRUCTION));
    assert_eq!(
        s.input_ids[n_prompt..],
        a.get(0).input_ids[a.get(0).loss_mask.iter().position(|&m| m).unwrap()..]
    );
}

#[test]
fn truncation_modes() {
    let dir = tempfile::tempdir().unwrap();
    let file = gsm8k_parquet(dir.path(), 3);
    let tok_dir = common::qwen_tokenizer();
    let full = SftDataset::load(&config(&[]).data, &tok_dir, std::slice::from_ref(&file)).unwrap();
    let n = full.get(0).len();
    let short = (n - 10).to_string();
    let err_cfg = config(&[&format!("data.max_length={short}")]);
    let err = format!(
        "{:#}",
        SftDataset::load(&err_cfg.data, &tok_dir, std::slice::from_ref(&file))
            .err()
            .unwrap()
    );
    assert!(err.contains(&format!("{} row 0", file.display())), "{err}");
    assert!(
        err.contains(&format!("{n} tokens, more than data.max_length={short}")),
        "{err}"
    );

    let mut cfg = err_cfg.clone();
    cfg.data.truncation = Truncation::Left;
    let left = SftDataset::load(&cfg.data, &tok_dir, std::slice::from_ref(&file)).unwrap();
    assert_eq!(left.get(0).input_ids, full.get(0).input_ids[10..]);
    assert_eq!(left.get(0).loss_mask[1..], full.get(0).loss_mask[11..]);
    assert!(!left.get(0).loss_mask[0]);
    cfg.data.truncation = Truncation::Right;
    let right = SftDataset::load(&cfg.data, &tok_dir, &[file]).unwrap();
    assert_eq!(right.get(0).input_ids, full.get(0).input_ids[..n - 10]);
    assert_eq!(right.get(0).loss_mask, full.get(0).loss_mask[..n - 10]);
}

#[test]
fn bad_rows_name_file_and_row() {
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.jsonl");
    std::fs::write(
        &bad,
        [
            json!({"question": "a", "answer": "b"}),
            json!({"question": "c", "answer": "d"}),
            json!({"question": "e", "answr": "f"}),
        ]
        .iter()
        .map(|v| v.to_string() + "\n")
        .collect::<String>(),
    )
    .unwrap();
    let cfg = config(&[]);
    let err = format!(
        "{:#}",
        SftDataset::load(
            &cfg.data,
            &common::qwen_tokenizer(),
            std::slice::from_ref(&bad)
        )
        .err()
        .unwrap()
    );
    assert!(
        err.contains(&format!(
            "{} row 2: no column `answer` (nearest: `answr`",
            bad.display()
        )),
        "{err}"
    );

    let pq = gsm8k_parquet(dir.path(), 2);
    let cfg = config(&["data.response_key=answr"]);
    let err = format!(
        "{:#}",
        SftDataset::load(
            &cfg.data,
            &common::qwen_tokenizer(),
            std::slice::from_ref(&pq)
        )
        .err()
        .unwrap()
    );
    assert!(
        err.contains(&format!(
            "{}: no column `answr` (nearest: `answer`",
            pq.display()
        )),
        "{err}"
    );
    let cfg = config(&[
        "data.prompt_key=extra_info",
        "data.prompt_dict_keys=[questoin]",
    ]);
    let err = format!(
        "{:#}",
        SftDataset::load(
            &cfg.data,
            &common::qwen_tokenizer(),
            std::slice::from_ref(&pq)
        )
        .err()
        .unwrap()
    );
    assert!(
        err.contains("row 0: `extra_info` has no key `questoin` (nearest: `question`"),
        "{err}"
    );
}
