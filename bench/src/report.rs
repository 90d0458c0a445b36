//! How every suite prints its figures: `name value unit` per line, or one JSON object per line with `--json`.

/// Collects and prints benchmark figures.
pub(crate) struct Report {
    json: bool,
}

impl Report {
    /// A report printing plain rows, or JSON lines when `json`.
    pub(crate) fn new(json: bool) -> Self {
        Self { json }
    }

    /// Prints one figure at once (so long suites show progress).
    #[allow(dead_code)]
    pub(crate) fn row(&mut self, name: &str, value: f64, unit: &str) {
        if self.json {
            println!(
                "{}",
                serde_json::json!({ "name": name, "value": value, "unit": unit })
            );
        } else {
            println!("{name} {value:.4} {unit}");
        }
    }

    /// Ends the report.
    pub(crate) fn finish(self) {}
}
