//! Writing rows of JSON objects (as [`crate::read::read_rows`] returns them) back to parquet, with the column types
//! inferred from the values (arrow's JSON schema inference): what `ferl generate` writes, the input's columns with
//! the generated ones added.

use std::path::Path;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use arrow::json::reader::{infer_json_schema_from_iterator, ReaderBuilder};
use serde_json::Value;

/// Writes `rows` (JSON objects) to the parquet file `path` (snappy), one column per key.
pub fn write_rows_parquet(rows: &[Value], path: &Path) -> Result<()> {
    if rows.is_empty() {
        bail!("{}: no rows to write", path.display());
    }
    let schema = infer_json_schema_from_iterator(rows.iter().map(Ok))
        .with_context(|| format!("{}: inferring the column types", path.display()))?;
    let mut decoder = ReaderBuilder::new(Arc::new(schema))
        .with_batch_size(rows.len())
        .build_decoder()?;
    decoder
        .serialize(rows)
        .with_context(|| format!("{}: converting the rows", path.display()))?;
    let Some(batch) = decoder.flush()? else {
        bail!("{}: no rows to write", path.display());
    };
    crate::gsm8k::write_parquet(&batch, path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_round_trip_through_parquet() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("rows.parquet");
        let rows: Vec<Value> = (0..3)
            .map(|i| {
                serde_json::json!({
                    "prompt": [{"role": "user", "content": format!("q{i}")}],
                    "extra_info": {"index": i, "split": "test"},
                    "responses": [format!("a{i}"), "b"],
                })
            })
            .collect();
        write_rows_parquet(&rows, &file).unwrap();
        assert_eq!(crate::read::read_rows(&file, None).unwrap(), rows);
    }
}
