//! Dataset plugin `alpaca`: Alpaca-style records `{"instruction", "input", "output"}` read from the file named by the
//! config string: a JSON array (`.json`), one object per line (`.jsonl`) or CSV with a header naming the three columns
//! (`.csv`; `input` may be absent). Each record becomes a prompt/response example: the prompt is the instruction,
//! followed by a blank line and the input when the input is not empty; the response is the output.

mod csv;

use ferl_plugin_abi::dataset::{DatasetPlugin, ExampleData};
use ferl_plugin_abi::Plugin;

/// The records of one file.
pub struct AlpacaDataset {
    records: Vec<Record>,
}

/// One instruction record.
#[derive(Clone, Debug, PartialEq)]
struct Record {
    instruction: String,
    input: String,
    output: String,
}

impl Record {
    fn prompt(&self) -> String {
        if self.input.trim().is_empty() {
            self.instruction.clone()
        } else {
            format!("{}\n\n{}", self.instruction, self.input)
        }
    }
}

impl Plugin for AlpacaDataset {
    const NAME: &'static str = "alpaca";
    const VERSION: &'static str = env!("CARGO_PKG_VERSION");
    const DESCRIPTION: &'static str =
        "Alpaca instruction/input/output records (JSON, JSON lines, CSV)";
}

/// A record from a JSON object; `what` names the file and record for errors.
fn from_json(v: &serde_json::Value, what: &str) -> Result<Record, String> {
    let field = |k: &str, required: bool| -> Result<String, String> {
        match v.get(k) {
            Some(serde_json::Value::String(s)) => Ok(s.clone()),
            Some(serde_json::Value::Null) | None if !required => Ok(String::new()),
            Some(other) => Err(format!("{what}: key `{k}` must be a string, found {other}")),
            None => Err(format!("{what}: missing key `{k}`")),
        }
    };
    if !v.is_object() {
        return Err(format!(
            "{what}: expected an object with instruction/input/output"
        ));
    }
    Ok(Record {
        instruction: field("instruction", true)?,
        input: field("input", false)?,
        output: field("output", true)?,
    })
}

fn read_json(path: &str, text: &str) -> Result<Vec<Record>, String> {
    let v: serde_json::Value =
        serde_json::from_str(text).map_err(|e| format!("{path}: not valid JSON: {e}"))?;
    let arr = v
        .as_array()
        .ok_or_else(|| format!("{path}: expected a JSON array of records"))?;
    arr.iter()
        .enumerate()
        .map(|(i, r)| from_json(r, &format!("{path} record {i}")))
        .collect()
}

fn read_jsonl(path: &str, text: &str) -> Result<Vec<Record>, String> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let what = format!("{path} line {}", i + 1);
        let v: serde_json::Value =
            serde_json::from_str(line).map_err(|e| format!("{what}: not valid JSON: {e}"))?;
        out.push(from_json(&v, &what)?);
    }
    Ok(out)
}

fn read_csv(path: &str, text: &str) -> Result<Vec<Record>, String> {
    let rows = csv::parse(text).map_err(|e| format!("{path}: {e}"))?;
    let Some((header, body)) = rows.split_first() else {
        return Ok(Vec::new());
    };
    let col = |name: &str| header.iter().position(|h| h.trim() == name);
    let need = |name: &str| {
        col(name).ok_or_else(|| {
            format!(
                "{path}: the header has no `{name}` column (found: {})",
                header.join(",")
            )
        })
    };
    let (ci, co, cin) = (need("instruction")?, need("output")?, col("input"));
    body.iter()
        .enumerate()
        .map(|(i, row)| {
            let get = |c: usize| {
                row.get(c).cloned().ok_or_else(|| {
                    format!(
                        "{path} row {}: {} fields, expected {}",
                        i + 2,
                        row.len(),
                        header.len()
                    )
                })
            };
            Ok(Record {
                instruction: get(ci)?,
                input: cin.map(get).transpose()?.unwrap_or_default(),
                output: get(co)?,
            })
        })
        .collect()
}

impl DatasetPlugin for AlpacaDataset {
    fn open(config: &str) -> Result<Self, String> {
        let path = config.trim();
        let text =
            std::fs::read_to_string(path).map_err(|e| format!("cannot read `{path}`: {e}"))?;
        let records = match std::path::Path::new(path)
            .extension()
            .and_then(|e| e.to_str())
        {
            Some("json") => read_json(path, &text)?,
            Some("jsonl") => read_jsonl(path, &text)?,
            Some("csv") => read_csv(path, &text)?,
            _ => {
                return Err(format!(
                    "`{path}`: unknown format; use a .json, .jsonl or .csv file"
                ))
            }
        };
        Ok(Self { records })
    }

    fn len(&self) -> u64 {
        self.records.len() as u64
    }

    fn get(&mut self, index: u64) -> Result<ExampleData, String> {
        let r = &self.records[index as usize];
        Ok(ExampleData::PromptResponse {
            prompt: r.prompt(),
            response: r.output.clone(),
        })
    }
}

ferl_plugin_abi::export_dataset!(AlpacaDataset);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_jsonl_and_csv_give_the_same_records() {
        let json = r#"[{"instruction":"Add","input":"2+2","output":"4"},{"instruction":"Greet","output":"hi"}]"#;
        let jsonl = "{\"instruction\":\"Add\",\"input\":\"2+2\",\"output\":\"4\"}\n\n{\"instruction\":\"Greet\",\"input\":null,\"output\":\"hi\"}\n";
        let csv = "instruction,input,output\nAdd,2+2,4\nGreet,,hi\n";
        let a = read_json("a.json", json).unwrap();
        assert_eq!(a, read_jsonl("a.jsonl", jsonl).unwrap());
        assert_eq!(a, read_csv("a.csv", csv).unwrap());
        assert_eq!(a[0].prompt(), "Add\n\n2+2");
        assert_eq!(a[1].prompt(), "Greet");
    }

    #[test]
    fn errors_name_file_record_and_key() {
        let e = read_json("x.json", r#"[{"instruction":"a"}]"#).unwrap_err();
        assert!(
            e.contains("x.json record 0") && e.contains("`output`"),
            "{e}"
        );
        let e = read_csv("x.csv", "instruction,input\na,b\n").unwrap_err();
        assert!(e.contains("x.csv") && e.contains("`output`"), "{e}");
    }
}
