//! [`SftDataset`]: every sample of some files, tokenized up front in parallel.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use ferl_config::DataConfig;
use rayon::prelude::*;

use crate::progress::Progress;
use crate::read::{Fields, FileSource};
use crate::sample::{SampleBuilder, TokenizedSample};
use crate::source::{DataSource, SourcedExample};
use crate::tokenizer::SftTokenizer;

/// Tokenized samples with the ids the collators need.
pub struct SftDataset {
    samples: Vec<TokenizedSample>,
    pad_id: i64,
    eos_id: i64,
}

impl SftDataset {
    /// Reads `files` (parquet or jsonl) with the `data.*` keys and tokenizes every row with the tokenizer in
    /// `tokenizer_dir`. Errors name the file and row at fault.
    pub fn load(cfg: &DataConfig, tokenizer_dir: &Path, files: &[PathBuf]) -> Result<Self> {
        Self::load_limited(cfg, tokenizer_dir, files, -1)
    }

    /// The training set: `data.train_files`, the first `data.train_max_samples` rows when that is positive.
    pub fn train(cfg: &DataConfig, tokenizer_dir: &Path) -> Result<Self> {
        let files = expand(cfg.train_files.as_slice());
        Self::load_limited(cfg, tokenizer_dir, &files, cfg.train_max_samples)
    }

    /// The validation set: `data.val_files`, the first `data.val_max_samples` rows when that is positive.
    pub fn val(cfg: &DataConfig, tokenizer_dir: &Path) -> Result<Self> {
        let files = expand(cfg.val_files.as_slice());
        Self::load_limited(cfg, tokenizer_dir, &files, cfg.val_max_samples)
    }

    fn load_limited(
        cfg: &DataConfig,
        tokenizer_dir: &Path,
        files: &[PathBuf],
        max_samples: i64,
    ) -> Result<Self> {
        if let Some(path) = &cfg.custom_cls.path {
            bail!("data.custom_cls.path={path}: ferl cannot load Python dataset classes; use a dataset plugin");
        }
        if let Some(name) = &cfg.plugin {
            bail!("data.plugin={name}: plugin datasets are built with SftDataset::from_sources by the plugin host");
        }
        let tokenizer = SftTokenizer::from_dir(tokenizer_dir, cfg.chat_template.as_deref())?;
        let fields = Fields::from_config(cfg);
        let mut sources: Vec<Box<dyn DataSource>> = files
            .iter()
            .map(|f| Box::new(FileSource::new(f, fields.clone())) as Box<dyn DataSource>)
            .collect();
        Self::from_sources(&mut sources, cfg, &tokenizer, max_samples)
    }

    /// Tokenizes the examples of `sources`, in order (the first `max_samples` when positive).
    pub fn from_sources(
        sources: &mut [Box<dyn DataSource>],
        cfg: &DataConfig,
        tokenizer: &SftTokenizer,
        max_samples: i64,
    ) -> Result<Self> {
        let mut examples = Vec::new();
        for s in sources.iter_mut() {
            examples.extend(
                s.examples()
                    .with_context(|| format!("reading {}", s.name()))?,
            );
        }
        if max_samples > 0 {
            examples.truncate(max_samples as usize);
        }
        Self::from_examples(&examples, cfg, tokenizer)
    }

    /// Tokenizes `examples` in parallel; the error of the first bad example (in order) is returned.
    pub fn from_examples(
        examples: &[SourcedExample],
        cfg: &DataConfig,
        tokenizer: &SftTokenizer,
    ) -> Result<Self> {
        let builder = SampleBuilder {
            tokenizer,
            max_length: cfg.max_length,
            truncation: cfg.truncation,
            template_kwargs: &cfg.apply_chat_template_kwargs,
        };
        let bar = Progress::new("tokenizing", "rows", examples.len() as u64);
        bar.set_position(0);
        let built: Vec<Result<TokenizedSample>> = examples
            .par_iter()
            .map(|ex| {
                let s = builder.build(ex);
                bar.inc(1);
                s
            })
            .collect();
        bar.finish();
        let samples = built.into_iter().collect::<Result<Vec<_>>>()?;
        Ok(Self {
            samples,
            pad_id: tokenizer.pad_token_id(),
            eos_id: tokenizer.eos_token_id(),
        })
    }

    /// A dataset of ready samples (tests, plugins).
    pub fn from_samples(samples: Vec<TokenizedSample>, pad_id: i64, eos_id: i64) -> Self {
        Self {
            samples,
            pad_id,
            eos_id,
        }
    }

    /// Number of samples.
    pub fn len(&self) -> usize {
        self.samples.len()
    }

    /// Whether there are no samples.
    pub fn is_empty(&self) -> bool {
        self.samples.is_empty()
    }

    /// Sample `i` (panics when out of range, like slice indexing).
    pub fn get(&self, i: usize) -> &TokenizedSample {
        &self.samples[i]
    }

    /// All samples, in file order.
    pub fn samples(&self) -> &[TokenizedSample] {
        &self.samples
    }

    /// The padding id.
    pub fn pad_token_id(&self) -> i64 {
        self.pad_id
    }

    /// The EOS id that ends every response.
    pub fn eos_token_id(&self) -> i64 {
        self.eos_id
    }
}

fn expand(files: &[String]) -> Vec<PathBuf> {
    files.iter().map(|f| ferl_config::expand_path(f)).collect()
}
