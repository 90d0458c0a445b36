//! Test plugin for `ferl-plugin-host`. One crate, several builds (see the features in `Cargo.toml`):
//!
//! - logger (default): config `PATH[;panic_at=STEP]`; appends `VERSION STEP NAME=VALUE` lines to `PATH` and panics
//!   when asked to log step `STEP`. Its version is `FERL_TESTKIT_VERSION` at build time, so a test can build v1 and v2.
//! - `dataset`: config `count=N[;panic_at=I]`; example `i` is the tokens `[i, i+1]` with mask `[0, 1]`; panics on `I`.
//! - `reward`: config `[panic_at=I][;nan_at=J]`; the score of a row is its response's length in characters, extra
//!   `gt_chars` the ground truth's; panics at row `I` of a batch, scores row `J` NaN. An empty config (what a
//!   trainer's `custom_reward_function.path` opens it with) is read from `$FERL_TESTKIT_REWARD` instead.
//! - `abi-mismatch`, `missing-table`: broken manifests the host must refuse.

use ferl_plugin_abi::Plugin;

/// The plugin's identity; the version comes from the build environment.
pub struct Testkit;

impl Plugin for Testkit {
    const NAME: &'static str = "testkit";
    const VERSION: &'static str = match option_env!("FERL_TESTKIT_VERSION") {
        Some(v) => v,
        None => "1.0.0",
    };
    const DESCRIPTION: &'static str = "ferl's test plugin";
}

/// Parses `key=value` options after the first `;`-separated field.
#[cfg(not(any(feature = "abi-mismatch", feature = "missing-table")))]
fn option(config: &str, key: &str) -> Result<Option<u64>, String> {
    for part in config.split(';') {
        if let Some(v) = part.strip_prefix(key).and_then(|r| r.strip_prefix('=')) {
            return v
                .parse()
                .map(Some)
                .map_err(|e| format!("option {key}={v}: {e}"));
        }
    }
    Ok(None)
}

#[cfg(not(any(
    feature = "dataset",
    feature = "reward",
    feature = "abi-mismatch",
    feature = "missing-table"
)))]
mod logger {
    use super::*;
    use ferl_plugin_abi::logger::LoggerPlugin;
    use std::io::Write;

    /// Appends lines to a file.
    pub(crate) struct TestLogger {
        out: std::io::BufWriter<std::fs::File>,
        panic_at: Option<u64>,
    }

    impl Plugin for TestLogger {
        const NAME: &'static str = Testkit::NAME;
        const VERSION: &'static str = Testkit::VERSION;
        const DESCRIPTION: &'static str = Testkit::DESCRIPTION;
    }

    impl LoggerPlugin for TestLogger {
        fn open(config: &str) -> Result<Self, String> {
            let path = config.split(';').next().unwrap_or_default();
            let file = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .map_err(|e| format!("cannot open {path}: {e}"))?;
            Ok(Self {
                out: std::io::BufWriter::new(file),
                panic_at: option(config, "panic_at")?,
            })
        }

        fn log(&mut self, step: u64, metrics: &[(&str, f64)]) -> Result<(), String> {
            if self.panic_at == Some(step) {
                panic!("testkit was told to panic at step {step}");
            }
            for (name, value) in metrics {
                writeln!(self.out, "{} {step} {name}={value}", Self::VERSION)
                    .map_err(|e| e.to_string())?;
            }
            Ok(())
        }

        fn flush(&mut self) -> Result<(), String> {
            self.out.flush().map_err(|e| e.to_string())
        }
    }

    ferl_plugin_abi::export_logger!(TestLogger);
}

#[cfg(feature = "dataset")]
mod dataset {
    use super::*;
    use ferl_plugin_abi::dataset::{DatasetPlugin, ExampleData};

    /// Synthetic examples.
    pub(crate) struct TestDataset {
        count: u64,
        panic_at: Option<u64>,
    }

    impl Plugin for TestDataset {
        const NAME: &'static str = Testkit::NAME;
        const VERSION: &'static str = Testkit::VERSION;
        const DESCRIPTION: &'static str = Testkit::DESCRIPTION;
    }

    impl DatasetPlugin for TestDataset {
        fn open(config: &str) -> Result<Self, String> {
            let count = option(config, "count")?
                .ok_or_else(|| format!("config `{config}` lacks count=N"))?;
            Ok(Self {
                count,
                panic_at: option(config, "panic_at")?,
            })
        }

        fn len(&self) -> u64 {
            self.count
        }

        fn get(&mut self, index: u64) -> Result<ExampleData, String> {
            if self.panic_at == Some(index) {
                panic!("testkit dataset was told to panic at example {index}");
            }
            let i = index as i64;
            Ok(ExampleData::Tokens {
                input_ids: vec![i, i + 1],
                loss_mask: vec![0, 1],
            })
        }
    }

    ferl_plugin_abi::export_dataset!(TestDataset);
}

#[cfg(feature = "reward")]
mod reward {
    use super::*;
    use ferl_plugin_abi::reward::{RewardInput, RewardPlugin, RewardScore};

    /// Lengths as scores, with panics and NaNs on request.
    pub(crate) struct TestReward {
        panic_at: Option<u64>,
        nan_at: Option<u64>,
    }

    impl Plugin for TestReward {
        const NAME: &'static str = Testkit::NAME;
        const VERSION: &'static str = Testkit::VERSION;
        const DESCRIPTION: &'static str = Testkit::DESCRIPTION;
    }

    impl RewardPlugin for TestReward {
        fn open(config: &str) -> Result<Self, String> {
            let from_env;
            let config = if config.is_empty() {
                from_env = std::env::var("FERL_TESTKIT_REWARD").unwrap_or_default();
                from_env.as_str()
            } else {
                config
            };
            Ok(Self {
                panic_at: option(config, "panic_at")?,
                nan_at: option(config, "nan_at")?,
            })
        }

        fn extra_names(&self) -> Vec<String> {
            vec!["gt_chars".to_string()]
        }

        fn score(&mut self, _row: &RewardInput<'_>) -> Result<RewardScore, String> {
            Err("testkit scores whole batches".to_string())
        }

        fn score_batch(&mut self, rows: &[RewardInput<'_>]) -> Result<Vec<RewardScore>, String> {
            let mut out = Vec::with_capacity(rows.len());
            for (i, row) in rows.iter().enumerate() {
                if self.panic_at == Some(i as u64) {
                    panic!("testkit reward was told to panic at row {i}");
                }
                let score = if self.nan_at == Some(i as u64) {
                    f32::NAN
                } else {
                    row.response.chars().count() as f32
                };
                let extras = vec![row.ground_truth.chars().count() as f32];
                out.push(RewardScore { score, extras });
            }
            Ok(out)
        }
    }

    ferl_plugin_abi::export_reward!(TestReward);
}

#[cfg(feature = "abi-mismatch")]
mod abi_mismatch {
    use ferl_plugin_abi::{FerlStr, Manifest, PluginKind, FERL_PLUGIN_ABI_VERSION};

    /// A manifest from "the future".
    #[no_mangle]
    pub extern "C" fn ferl_plugin_manifest() -> *const Manifest {
        static MANIFEST: Manifest = Manifest {
            struct_size: std::mem::size_of::<Manifest>(),
            abi_version: FERL_PLUGIN_ABI_VERSION + 1000,
            kind: PluginKind::Logger as u32,
            name: FerlStr::new("testkit"),
            version: FerlStr::new("9.9.9"),
            description: FerlStr::new("built against another ABI"),
        };
        &MANIFEST
    }
}

#[cfg(feature = "missing-table")]
mod missing_table {
    ferl_plugin_abi::__export_manifest!(super::Testkit, ferl_plugin_abi::PluginKind::Logger);
}
