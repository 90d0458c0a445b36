//! Template ferl plugin: a logger that appends one JSON object per step, `{"step": 3, "train/loss": 1.25}`, to the
//! file named by its config string, and a reward function ([`reward`], exported instead with `--features reward`).
//! Copy this crate to write your own plugin.

pub mod reward;

use ferl_plugin_abi::logger::LoggerPlugin;
use ferl_plugin_abi::Plugin;
use std::io::Write;

/// The logger: an open file.
pub struct JsonlLogger {
    out: std::io::BufWriter<std::fs::File>,
}

impl Plugin for JsonlLogger {
    // The name configs use: `trainer.logger=[console,template]`.
    const NAME: &'static str = "template";
    const VERSION: &'static str = env!("CARGO_PKG_VERSION");
    const DESCRIPTION: &'static str = "one JSON object per step (plugin template)";
}

/// `s` as a JSON string literal.
fn json_string(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// `v` as a JSON number (JSON has no NaN or infinity: those become `null`).
fn json_number(v: f64) -> String {
    if v.is_finite() {
        format!("{v}")
    } else {
        "null".to_string()
    }
}

impl LoggerPlugin for JsonlLogger {
    fn open(config: &str) -> Result<Self, String> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(config)
            .map_err(|e| format!("cannot open `{config}` for appending: {e}"))?;
        Ok(Self {
            out: std::io::BufWriter::new(file),
        })
    }

    fn log(&mut self, step: u64, metrics: &[(&str, f64)]) -> Result<(), String> {
        let mut line = format!("{{\"step\":{step}");
        for (name, value) in metrics {
            line.push_str(&format!(",{}:{}", json_string(name), json_number(*value)));
        }
        line.push('}');
        writeln!(self.out, "{line}").map_err(|e| format!("write failed: {e}"))
    }

    fn flush(&mut self) -> Result<(), String> {
        self.out.flush().map_err(|e| format!("flush failed: {e}"))
    }
}

#[cfg(not(feature = "reward"))]
ferl_plugin_abi::export_logger!(JsonlLogger);
#[cfg(feature = "reward")]
ferl_plugin_abi::export_reward!(reward::ExactMatch);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_names_and_non_finite_values() {
        assert_eq!(json_string("a\"b\\c\n"), "\"a\\\"b\\\\c\\u000a\"");
        assert_eq!(json_number(f64::NAN), "null");
        assert_eq!(json_number(1.5), "1.5");
    }
}
