//! Fuzzing the data readers: parquet and jsonl files as `data.train_files` names them, read into examples with the
//! single-turn (`prompt_key`/`response_key`, nested `*_dict_keys`) and multi-turn (`messages`) fields. No panic, no
//! hang, every refusal an error naming the file.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow::array::{ArrayRef, Int64Array, ListArray, RecordBatch, StringArray, StructArray};
use arrow::buffer::OffsetBuffer;
use arrow::datatypes::{DataType, Field, Fields as ArrowFields, Schema};
use ferl_data::read::{read_rows, Fields, FileSource};
use ferl_data::DataSource;
use ferl_fuzz::{Answer, Expect, Target};
use parquet::arrow::ArrowWriter;
use parquet::basic::Compression;
use parquet::file::properties::WriterProperties;
use proptest::prelude::*;

thread_local! {
    static DIR: tempfile::TempDir = tempfile::tempdir().expect("temp dir");
}

/// The ways `data.*` reads a file: flat columns, nested dict keys, multi-turn messages.
fn field_sets() -> [Fields; 3] {
    let single = |prompt_dict_keys: Vec<String>| Fields::SingleTurn {
        prompt_key: "question".into(),
        prompt_dict_keys,
        response_key: "answer".into(),
        response_dict_keys: vec![],
    };
    [
        single(vec![]),
        single(vec!["text".into()]),
        Fields::MultiTurn {
            messages_key: "messages".into(),
            tools_key: "tools".into(),
            enable_thinking_key: "enable_thinking".into(),
        },
    ]
}

/// Writes `input` to `data.<ext>` and reads it every way; accepted when one way yields examples.
fn read_file(input: &[u8], ext: &str) -> Answer {
    let path: PathBuf = DIR.with(|d| d.path().join(format!("data.{ext}")));
    std::fs::write(&path, input).expect("writing the data file");
    let mut answer = read_rows(&path, None)
        .map(drop)
        .map_err(|e| message(&path, e));
    for fields in field_sets() {
        match FileSource::new(&path, fields).examples() {
            Ok(_) => answer = Ok(()),
            Err(e) => drop(message(&path, e)),
        }
    }
    answer
}

/// The error's text, which must name the file.
fn message(path: &Path, e: anyhow::Error) -> String {
    let text = format!("{e:#}");
    assert!(
        text.contains(&path.display().to_string()),
        "an error that does not name the file: {text}"
    );
    text
}

/// One row: question, answer, a number, and (role, content) messages.
type Row = (String, String, i64, Vec<(String, String)>);

fn row() -> impl Strategy<Value = Row> {
    let role = prop::sample::select(vec!["user", "assistant", "system", "tool", ""]);
    (
        ".{0,24}",
        ".{0,24}",
        any::<i64>(),
        prop::collection::vec((role.prop_map(String::from), ".{0,16}"), 0..4),
    )
}

fn messages_array(rows: &[Row]) -> ListArray {
    let all: Vec<&(String, String)> = rows.iter().flat_map(|r| r.3.iter()).collect();
    let roles: ArrayRef = Arc::new(StringArray::from_iter_values(
        all.iter().map(|m| m.0.as_str()),
    ));
    let contents: ArrayRef = Arc::new(StringArray::from_iter_values(
        all.iter().map(|m| m.1.as_str()),
    ));
    let fields = ArrowFields::from(vec![
        Field::new("role", DataType::Utf8, false),
        Field::new("content", DataType::Utf8, false),
    ]);
    let structs = StructArray::new(fields.clone(), vec![roles, contents], None);
    let offsets = OffsetBuffer::from_lengths(rows.iter().map(|r| r.3.len()));
    let item = Arc::new(Field::new("item", DataType::Struct(fields), true));
    ListArray::new(item, offsets, Arc::new(structs), None)
}

/// A parquet file of random rows: `question`, `answer`, `n` and `messages` columns.
fn parquet_file() -> impl Strategy<Value = Vec<u8>> {
    let compression = prop::sample::select(vec![Compression::UNCOMPRESSED, Compression::SNAPPY]);
    (prop::collection::vec(row(), 0..8), compression).prop_map(|(rows, compression)| {
        let question: ArrayRef = Arc::new(StringArray::from_iter_values(
            rows.iter().map(|r| r.0.as_str()),
        ));
        let answer: ArrayRef = Arc::new(StringArray::from_iter_values(
            rows.iter().map(|r| r.1.as_str()),
        ));
        let n: ArrayRef = Arc::new(Int64Array::from_iter_values(rows.iter().map(|r| r.2)));
        let messages: ArrayRef = Arc::new(messages_array(&rows));
        let columns = [
            ("question", question),
            ("answer", answer),
            ("n", n),
            ("messages", messages),
        ];
        let schema = Schema::new(
            columns
                .iter()
                .map(|(name, a)| Field::new(*name, a.data_type().clone(), true))
                .collect::<Vec<_>>(),
        );
        let arrays = columns.into_iter().map(|(_, a)| a).collect();
        let batch = RecordBatch::try_new(Arc::new(schema), arrays).expect("a record batch");
        let props = WriterProperties::builder()
            .set_compression(compression)
            .build();
        let mut out = Vec::new();
        let mut writer =
            ArrowWriter::try_new(&mut out, batch.schema(), Some(props)).expect("a writer");
        writer.write(&batch).expect("written");
        writer.close().expect("closed");
        out
    })
}

/// JSON lines of random rows in the three shapes.
fn jsonl_file() -> impl Strategy<Value = Vec<u8>> {
    prop::collection::vec((row(), 0..3u8), 0..8).prop_map(|rows| {
        let lines: Vec<String> = rows
            .into_iter()
            .map(|((q, a, n, msgs), shape)| {
                let messages: Vec<_> = msgs.iter().map(|(r, c)| serde_json::json!({"role": r, "content": c})).collect();
                let row = match shape {
                    0 => serde_json::json!({"question": q, "answer": a}),
                    1 => serde_json::json!({"question": [{"text": q}], "answer": n}),
                    _ => serde_json::json!({"messages": messages, "tools": "[]", "enable_thinking": n % 2 == 0}),
                };
                row.to_string()
            })
            .collect();
        lines.join("\n").into_bytes()
    })
}

#[test]
fn fuzz_parquet_reader() {
    Target::new("data-parquet", |b: &[u8]| read_file(b, "parquet"))
        .generate("parquet files", parquet_file(), Expect::Any)
        .dictionary(&[b"PAR1", &[0x15, 0x00], &[0x19, 0x1c], &[0x18, 0x08]])
        .max_len(64 << 10)
        .run();
}

#[test]
fn fuzz_jsonl_reader() {
    Target::new("data-jsonl", |b: &[u8]| read_file(b, "jsonl"))
        .generate("jsonl files", jsonl_file(), Expect::Any)
        .seconds(10)
        .dictionary(&[
            b"{",
            b"}",
            b"[",
            b"]",
            b"\"role\"",
            b"\"content\"",
            b"\"question\"",
            b"\"answer\"",
            b"\n",
            b"null",
            b"\\u0000",
            b"\\ud800",
        ])
        .max_len(64 << 10)
        .run();
}
