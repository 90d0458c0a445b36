//! Measures preparing and tokenizing GSM8K: `cargo run --release -p ferl-data --example tokenize_gsm8k
//! [GSM8K_DIR] [TOKENIZER_DIR]`. Prints `name value unit` rows like the benchmarks under bench/.

use std::path::PathBuf;
use std::time::Instant;

use ferl_config::SftConfig;
use ferl_data::gsm8k::prepare_gsm8k;
use ferl_data::SftDataset;

fn main() -> anyhow::Result<()> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../assets");
    let mut args = std::env::args().skip(1);
    let raw = args
        .next()
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("data/gsm8k"));
    let tok = args
        .next()
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("tokenizers/qwen3"));
    let out = tempfile::tempdir()?;

    let t = Instant::now();
    let summary = prepare_gsm8k(&raw, out.path())?;
    println!("gsm8k_prepare_s {:.3} s", t.elapsed().as_secs_f64());

    let cfg = SftConfig::load(
        None,
        &[
            "data.truncation=right".into(),
            "data.max_length=1024".into(),
        ],
    )?;
    let t = Instant::now();
    let ds = SftDataset::load(&cfg.data, &tok, &[out.path().join("train.parquet")])?;
    let secs = t.elapsed().as_secs_f64();
    let tokens: usize = ds.samples().iter().map(|s| s.len()).sum();
    let targets: usize = ds.samples().iter().map(|s| s.num_targets()).sum();
    println!("gsm8k_train_rows {} rows", summary.train_rows);
    println!("gsm8k_tokenize_s {secs:.3} s");
    println!(
        "gsm8k_tokenize_rows_per_s {:.0} rows/s",
        ds.len() as f64 / secs
    );
    println!("gsm8k_tokens {tokens} tokens");
    println!(
        "gsm8k_target_fraction {:.3} ratio",
        targets as f64 / tokens as f64
    );
    println!("threads {} threads", rayon::current_num_threads());
    Ok(())
}
