//! `ferl data gsm8k`'s preparation: verl's columns plus flat question/answer, readable by arrow and by pyarrow.

mod common;

use ferl_data::gsm8k::{prepare_gsm8k, DATA_SOURCE, INSTRUCTION};
use ferl_data::read::read_rows;
use serde_json::Value;

#[test]
fn gsm8k_parquet_round_trip_has_verls_columns() {
    let out = tempfile::tempdir().unwrap();
    let summary = prepare_gsm8k(&common::gsm8k_raw(), out.path()).unwrap();
    assert_eq!((summary.train_rows, summary.test_rows), (7473, 1319));
    let raw = read_rows(&common::gsm8k_raw().join("train.jsonl"), None).unwrap();
    let rows = read_rows(&out.path().join("train.parquet"), None).unwrap();
    assert_eq!(rows.len(), raw.len());
    let (r, src) = (&rows[1], &raw[1]);
    let q = src["question"].as_str().unwrap();
    let a = src["answer"].as_str().unwrap();
    assert_eq!(r["data_source"], DATA_SOURCE);
    assert_eq!(r["ability"], "math");
    assert_eq!(
        r["prompt"],
        serde_json::json!([{"role": "user", "content": format!("{q} {INSTRUCTION}")}])
    );
    assert_eq!(
        r["reward_model"],
        serde_json::json!({"style": "rule", "ground_truth": "10"})
    );
    assert_eq!(
        r["extra_info"],
        serde_json::json!({"split": "train", "index": 1, "answer": a, "question": q})
    );
    assert_eq!(
        (r["question"].as_str(), r["answer"].as_str()),
        (Some(q), Some(a))
    );
    let test_rows = read_rows(&out.path().join("test.parquet"), None).unwrap();
    assert_eq!(test_rows[5]["extra_info"]["split"], "test");
    assert_eq!(test_rows[5]["extra_info"]["index"], 5);
}

#[test]
fn gsm8k_parquet_reads_back_in_pyarrow() {
    let Some(py) = common::venv_python("pyarrow") else {
        return;
    };
    let out = tempfile::tempdir().unwrap();
    prepare_gsm8k(&common::gsm8k_raw(), out.path()).unwrap();
    let script = r#"
import json, sys, pyarrow.parquet as pq
t = pq.read_table(sys.argv[1])
print(json.dumps({"names": t.column_names, "rows": t.num_rows, "first": t.slice(0, 1).to_pylist()[0]}))
"#;
    let o = std::process::Command::new(py)
        .args([
            "-c",
            script,
            out.path().join("test.parquet").to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let got: Value = serde_json::from_slice(&o.stdout).unwrap();
    let names: Vec<&str> = got["names"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "data_source",
            "prompt",
            "ability",
            "reward_model",
            "extra_info",
            "question",
            "answer"
        ]
    );
    assert_eq!(got["rows"], 1319);
    let ours = &read_rows(&out.path().join("test.parquet"), None).unwrap()[0];
    assert_eq!(&got["first"], ours);
}
