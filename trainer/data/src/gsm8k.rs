//! `ferl data gsm8k`: GSM8K (`question`, `answer` rows) into verl's `train.parquet`/`test.parquet` layout
//! (examples/data_preprocess/gsm8k.py), plus flat `question`/`answer` columns so both
//! `data.prompt_key=question data.response_key=answer` and verl's
//! `data.prompt_key=extra_info data.prompt_dict_keys=[question]` forms read it.
//!
//! Columns: `data_source` ("openai/gsm8k"), `prompt` (list of `{role, content}`: the question and
//! [`INSTRUCTION`]), `ability` ("math"), `reward_model` (`{style: "rule", ground_truth}`), `extra_info`
//! (`{split, index, answer, question}`), `question`, `answer`.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{anyhow, bail, Context, Result};
use arrow::array::{ArrayRef, Int64Array, ListArray, RecordBatch, StringArray, StructArray};
use arrow::buffer::OffsetBuffer;
use arrow::datatypes::{DataType, Field, Fields, Schema};
use parquet::arrow::ArrowWriter;
use parquet::basic::Compression;
use parquet::file::properties::WriterProperties;
use serde_json::Value;

use crate::read::read_rows;

/// The data source name verl's reward functions key on.
pub const DATA_SOURCE: &str = "openai/gsm8k";

/// verl's instruction appended (after a space) to each question in the `prompt` column.
pub const INSTRUCTION: &str =
    "Let's think step by step and output the final answer after \"####\".";

/// How many rows each split got.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Gsm8kSummary {
    /// Rows in `train.parquet`.
    pub train_rows: usize,
    /// Rows in `test.parquet`.
    pub test_rows: usize,
}

/// The final answer after `#### ` (commas removed), as verl's `extract_solution`; `None` when there is none.
pub fn extract_solution(answer: &str) -> Option<String> {
    let mut rest = answer;
    while let Some(at) = rest.find("#### ") {
        let after = &rest[at + 5..];
        let sign = usize::from(after.starts_with('-'));
        let digits = after[sign..]
            .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == ','))
            .unwrap_or(after.len() - sign);
        if digits > 0 {
            return Some(after[..sign + digits].replace(',', ""));
        }
        rest = after;
    }
    None
}

/// Reads `input_dir`'s train and test splits (`train.jsonl`, `train.parquet` or HF's
/// `main/train-00000-of-00001.parquet`; same for test) and writes `local_dir/{train,test}.parquet`.
pub fn prepare_gsm8k(input_dir: &Path, local_dir: &Path) -> Result<Gsm8kSummary> {
    std::fs::create_dir_all(local_dir)
        .with_context(|| format!("creating {}", local_dir.display()))?;
    let mut counts = [0; 2];
    for (i, split) in ["train", "test"].into_iter().enumerate() {
        let input = find_split(input_dir, split)?;
        let rows = read_rows(&input, None)?;
        let batch = gsm8k_batch(&rows, split, &input.display().to_string())?;
        let out = local_dir.join(format!("{split}.parquet"));
        write_parquet(&batch, &out)?;
        counts[i] = batch.num_rows();
    }
    Ok(Gsm8kSummary {
        train_rows: counts[0],
        test_rows: counts[1],
    })
}

fn find_split(dir: &Path, split: &str) -> Result<PathBuf> {
    let candidates = [
        format!("{split}.jsonl"),
        format!("{split}.parquet"),
        format!("main/{split}-00000-of-00001.parquet"),
    ];
    candidates
        .iter()
        .map(|c| dir.join(c))
        .find(|p| p.exists())
        .ok_or_else(|| {
            anyhow!(
                "{}: no GSM8K {split} split (looked for {})",
                dir.display(),
                candidates.join(", ")
            )
        })
}

/// The verl-layout record batch of `rows` (`{question, answer}` objects) of `split`; errors name `file` and row.
pub fn gsm8k_batch(rows: &[Value], split: &str, file: &str) -> Result<RecordBatch> {
    let n = rows.len();
    let mut questions = Vec::with_capacity(n);
    let mut answers = Vec::with_capacity(n);
    let mut solutions = Vec::with_capacity(n);
    for (row, v) in rows.iter().enumerate() {
        let field = |k: &str| {
            v.get(k)
                .and_then(Value::as_str)
                .ok_or_else(|| anyhow!("{file} row {row}: no string `{k}`"))
        };
        let (q, a) = (field("question")?, field("answer")?);
        let Some(sol) = extract_solution(a) else {
            bail!("{file} row {row}: the answer has no final `#### <number>`");
        };
        questions.push(q.to_string());
        answers.push(a.to_string());
        solutions.push(sol);
    }
    let utf8 = |name: &str| Field::new(name, DataType::Utf8, true);
    let strings = |v: Vec<String>| Arc::new(StringArray::from(v)) as ArrayRef;
    let same = |s: &str| strings(vec![s.to_string(); n]);

    let message_fields = Fields::from(vec![utf8("role"), utf8("content")]);
    let contents = questions
        .iter()
        .map(|q| format!("{q} {INSTRUCTION}"))
        .collect();
    let messages = StructArray::new(
        message_fields.clone(),
        vec![same("user"), strings(contents)],
        None,
    );
    let item = Arc::new(Field::new("item", DataType::Struct(message_fields), true));
    let prompt = ListArray::new(
        item,
        OffsetBuffer::from_lengths(vec![1; n]),
        Arc::new(messages),
        None,
    );

    let reward_fields = Fields::from(vec![utf8("style"), utf8("ground_truth")]);
    let reward = StructArray::new(reward_fields, vec![same("rule"), strings(solutions)], None);

    let extra_fields = Fields::from(vec![
        utf8("split"),
        Field::new("index", DataType::Int64, true),
        utf8("answer"),
        utf8("question"),
    ]);
    let index = Arc::new(Int64Array::from_iter_values(0..n as i64)) as ArrayRef;
    let extra = StructArray::new(
        extra_fields,
        vec![
            same(split),
            index,
            strings(answers.clone()),
            strings(questions.clone()),
        ],
        None,
    );

    let columns: Vec<(&str, ArrayRef)> = vec![
        ("data_source", same(DATA_SOURCE)),
        ("prompt", Arc::new(prompt)),
        ("ability", same("math")),
        ("reward_model", Arc::new(reward)),
        ("extra_info", Arc::new(extra)),
        ("question", strings(questions)),
        ("answer", strings(answers)),
    ];
    let schema = Schema::new(
        columns
            .iter()
            .map(|(name, a)| Field::new(*name, a.data_type().clone(), true))
            .collect::<Vec<_>>(),
    );
    let arrays = columns.into_iter().map(|(_, a)| a).collect();
    Ok(RecordBatch::try_new(Arc::new(schema), arrays)?)
}

/// Writes one record batch as a snappy-compressed parquet file.
pub fn write_parquet(batch: &RecordBatch, path: &Path) -> Result<()> {
    let file = File::create(path).with_context(|| format!("creating {}", path.display()))?;
    let props = WriterProperties::builder()
        .set_compression(Compression::SNAPPY)
        .build();
    let mut writer = ArrowWriter::try_new(file, batch.schema(), Some(props))?;
    writer
        .write(batch)
        .with_context(|| format!("writing {}", path.display()))?;
    writer
        .close()
        .with_context(|| format!("finishing {}", path.display()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extract_solution_matches_verls_rule() {
        assert_eq!(
            extract_solution("so 3+4 = 7\n#### 72").as_deref(),
            Some("72")
        );
        assert_eq!(extract_solution("#### 1,234.5").as_deref(), Some("1234.5"));
        assert_eq!(extract_solution("x #### -3").as_deref(), Some("-3"));
        assert_eq!(
            extract_solution("#### none then #### 9").as_deref(),
            Some("9")
        );
        assert_eq!(extract_solution("no marker 42"), None);
    }

    #[test]
    fn a_row_without_a_final_answer_names_file_and_row() {
        let rows = vec![
            serde_json::json!({"question": "q", "answer": "#### 1"}),
            serde_json::json!({"question": "q", "answer": "none"}),
        ];
        let err = gsm8k_batch(&rows, "train", "in.jsonl")
            .unwrap_err()
            .to_string();
        assert_eq!(
            err,
            "in.jsonl row 1: the answer has no final `#### <number>`"
        );
    }
}
