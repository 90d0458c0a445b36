//! Fuzzing the model weight readers: `model.safetensors` (header JSON, dtypes, shapes, offsets) and
//! `model.safetensors.index.json`, as `model.partial_pretrain` loads them. No panic, no hang, every refusal an error
//! naming the file.

use std::collections::HashMap;

use ferl_fuzz::{Answer, Expect, Target};
use ferl_trainer::model::weights::{read_tensors, weight_files};
use proptest::prelude::*;
use safetensors::tensor::{Dtype, TensorView};

thread_local! {
    static DIR: tempfile::TempDir = tempfile::tempdir().expect("temp dir");
}

/// `input[0]` even: the input is `model.safetensors`; odd: it is the index (naming `model.safetensors`, which then
/// holds a valid file) and the shards it names are read.
fn read_weights(input: &[u8]) -> Answer {
    let Some((&kind, body)) = input.split_first() else {
        return Err("empty input".into());
    };
    DIR.with(|dir| {
        let dir = dir.path();
        let index = dir.join("model.safetensors.index.json");
        let _ = std::fs::remove_file(&index);
        if kind % 2 == 0 {
            std::fs::write(dir.join("model.safetensors"), body).expect("writing the weights");
        } else {
            std::fs::write(dir.join("model.safetensors"), valid_file())
                .expect("writing the weights");
            std::fs::write(&index, body).expect("writing the index");
        }
        let files = weight_files(dir).map_err(|e| format!("{e:#}"))?;
        let tensors = read_tensors(&files).map_err(|e| {
            let text = format!("{e:#}");
            assert!(
                files
                    .iter()
                    .any(|f| text.contains(&f.display().to_string())),
                "an error naming no file: {text}"
            );
            text
        })?;
        drop(tensors);
        Ok(())
    })
}

fn valid_file() -> Vec<u8> {
    let data = [0u8; 16];
    let view = TensorView::new(Dtype::F32, vec![2, 2], &data).expect("a view");
    safetensors::serialize([("w", view)], None).expect("serialised")
}

const DTYPES: &[(Dtype, usize)] = &[
    (Dtype::F32, 4),
    (Dtype::BF16, 2),
    (Dtype::F16, 2),
    (Dtype::F64, 8),
    (Dtype::I64, 8),
    (Dtype::U8, 1),
];

/// A valid safetensors file of a few small tensors (some of unsupported dtypes, some empty), with metadata.
fn safetensors_file() -> impl Strategy<Value = Vec<u8>> {
    let tensor = (
        "[a-z._]{1,12}",
        0..DTYPES.len(),
        prop::collection::vec(0..4usize, 0..4),
    );
    (
        prop::collection::vec(tensor, 0..4),
        prop::option::of("[a-z]{0,8}"),
    )
        .prop_map(|(tensors, meta)| {
            let datas: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = tensors
                .into_iter()
                .map(|(name, d, shape)| {
                    let (dtype, size) = DTYPES[d];
                    let len = shape.iter().product::<usize>() * size;
                    (name, dtype, shape, (0..len).map(|i| i as u8).collect())
                })
                .collect();
            let mut views = HashMap::new();
            for (name, dtype, shape, data) in &datas {
                views.insert(
                    name.clone(),
                    TensorView::new(*dtype, shape.clone(), data).expect("a view"),
                );
            }
            let meta = meta.map(|m| HashMap::from([("format".to_string(), m)]));
            let mut out = vec![0u8];
            out.extend(safetensors::serialize(views, meta).expect("serialised"));
            out
        })
}

/// A header written by hand: edge-case dimensions and offsets that no writer produces.
fn edge_header() -> impl Strategy<Value = Vec<u8>> {
    let edge = prop::sample::select(vec![
        0u64,
        1,
        3,
        1 << 31,
        1 << 32,
        1 << 62,
        1 << 63,
        u64::MAX,
    ]);
    let dtype = prop::sample::select(vec!["F32", "BF16", "I64", "BOOL", "F8_E4M3", "X"]);
    (dtype, prop::collection::vec(edge.clone(), 0..4), edge.clone(), edge, 0..64usize).prop_map(
        |(dtype, shape, start, end, data)| {
            let header = serde_json::json!({"t": {"dtype": dtype, "shape": shape, "data_offsets": [start, end]}});
            let header = header.to_string().into_bytes();
            let mut out = vec![0u8];
            out.extend_from_slice(&(header.len() as u64).to_le_bytes());
            out.extend(header);
            out.extend(std::iter::repeat_n(7u8, data));
            out
        },
    )
}

/// An index naming shards (some present, some missing, some outside the folder).
fn index_file() -> impl Strategy<Value = Vec<u8>> {
    let shard = prop::sample::select(vec![
        "model.safetensors",
        "missing.safetensors",
        "../x.safetensors",
        "/etc/hostname",
        "",
    ]);
    prop::collection::vec(("[a-z.]{1,10}", shard), 0..4).prop_map(|entries| {
        let map: serde_json::Map<String, serde_json::Value> = entries
            .into_iter()
            .map(|(k, v)| (k, serde_json::Value::from(v)))
            .collect();
        let mut out = vec![1u8];
        out.extend(
            serde_json::json!({"metadata": {"total_size": 16}, "weight_map": map})
                .to_string()
                .into_bytes(),
        );
        out
    })
}

#[test]
fn fuzz_safetensors_reader() {
    Target::new("trainer-safetensors", read_weights)
        .generate("safetensors files", safetensors_file(), Expect::Any)
        .generate("index files", index_file(), Expect::Any)
        .generate("edge headers", edge_header(), Expect::Any)
        .dictionary(&[
            b"\"dtype\"",
            b"\"shape\"",
            b"\"data_offsets\"",
            b"\"__metadata__\"",
            b"\"F32\"",
            b"\"BF16\"",
            b"\"I64\"",
            b"[",
            b"]",
            b"18446744073709551615",
            b"9223372036854775808",
            b"\"weight_map\"",
        ])
        .max_len(64 << 10)
        .run();
}
