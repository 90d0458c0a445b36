//! Logger plugin `csv`: appends `step,name,value` rows (long format, so steps may log different metrics) to the file
//! named by the config string, writing the header when the file is new.

use ferl_plugin_abi::logger::LoggerPlugin;
use ferl_plugin_abi::Plugin;
use std::io::Write;

/// An open CSV file.
pub struct CsvLogger {
    out: std::io::BufWriter<std::fs::File>,
}

impl Plugin for CsvLogger {
    const NAME: &'static str = "csv";
    const VERSION: &'static str = env!("CARGO_PKG_VERSION");
    const DESCRIPTION: &'static str = "metrics as step,name,value CSV rows";
}

/// `field` quoted as RFC 4180 requires when it holds a comma, quote or line break.
fn csv_field(field: &str) -> String {
    if field.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", field.replace('"', "\"\""))
    } else {
        field.to_string()
    }
}

impl LoggerPlugin for CsvLogger {
    fn open(config: &str) -> Result<Self, String> {
        let path = std::path::Path::new(config);
        let is_new = std::fs::metadata(path)
            .map(|m| m.len() == 0)
            .unwrap_or(true);
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .map_err(|e| format!("cannot open `{config}` for appending: {e}"))?;
        let mut out = std::io::BufWriter::new(file);
        if is_new {
            writeln!(out, "step,name,value")
                .map_err(|e| format!("cannot write `{config}`: {e}"))?;
        }
        Ok(Self { out })
    }

    fn log(&mut self, step: u64, metrics: &[(&str, f64)]) -> Result<(), String> {
        for (name, value) in metrics {
            writeln!(self.out, "{step},{},{value}", csv_field(name))
                .map_err(|e| format!("write failed: {e}"))?;
        }
        Ok(())
    }

    fn flush(&mut self) -> Result<(), String> {
        self.out.flush().map_err(|e| format!("flush failed: {e}"))
    }
}

ferl_plugin_abi::export_logger!(CsvLogger);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quotes_only_fields_that_need_it() {
        assert_eq!(csv_field("train/loss"), "train/loss");
        assert_eq!(csv_field("a,b"), "\"a,b\"");
        assert_eq!(csv_field("say \"hi\""), "\"say \"\"hi\"\"\"");
    }

    #[test]
    fn writes_header_once_and_rows() {
        let dir = std::env::temp_dir().join(format!("ferl-csv-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("m.csv");
        let _ = std::fs::remove_file(&path);
        for step in 1..=2 {
            let mut l = CsvLogger::open(path.to_str().unwrap()).unwrap();
            l.log(step, &[("loss", 0.5 * step as f64)]).unwrap();
            l.flush().unwrap();
        }
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            "step,name,value\n1,loss,0.5\n2,loss,1\n"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
