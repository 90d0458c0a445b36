//! Dataset plugins as trainer data sources (`data.plugin=NAME`, `data.plugin_options`).

use anyhow::{anyhow, bail, Context, Result};
use ferl_plugin_host::{DatasetExample, DatasetInstance, PluginHost, PluginKind};
use ferl_trainer::config::{expand_path, DataConfig, SftConfig};
use ferl_trainer::data::{
    DataSource, Origin, Prompt, RawExample, SftDataset, SftTokenizer, SourcedExample,
};
use std::path::Path;

/// One open dataset plugin instance.
pub struct PluginDataSource {
    instance: DatasetInstance,
    label: String,
}

impl PluginDataSource {
    /// Opens dataset plugin `name` of `host` with `config`.
    pub fn open(host: &PluginHost, name: &str, config: &str) -> Result<Self> {
        let plugin = host.get_kind(name, PluginKind::Dataset)?;
        let label = format!("{} ({config})", plugin.label());
        Ok(Self {
            instance: DatasetInstance::open(plugin, config)?,
            label,
        })
    }
}

/// The config string for one file: the path alone, or, when `data.plugin_options` is not empty, a JSON object of
/// the options plus `"path"`.
pub fn dataset_config(file: &str, cfg: &DataConfig) -> String {
    if cfg.plugin_options.is_empty() {
        return file.to_string();
    }
    let mut o: serde_json::Map<String, serde_json::Value> = cfg
        .plugin_options
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    o.insert("path".into(), serde_json::Value::String(file.to_string()));
    serde_json::Value::Object(o).to_string()
}

fn to_raw(ex: DatasetExample, origin: &Origin) -> Result<RawExample> {
    Ok(match ex {
        DatasetExample::PromptResponse { prompt, response } => RawExample::PromptResponse {
            prompt: Prompt::Text(prompt),
            response,
        },
        DatasetExample::MessagesJson(json) => {
            let v: serde_json::Value = serde_json::from_str(&json)
                .with_context(|| format!("{origin}: messages are not valid JSON"))?;
            let messages = v
                .as_array()
                .cloned()
                .ok_or_else(|| anyhow!("{origin}: messages must be a JSON array"))?;
            RawExample::Messages {
                messages,
                tools: None,
                enable_thinking: None,
            }
        }
        DatasetExample::Tokens {
            input_ids,
            loss_mask,
        } => RawExample::Tokens {
            input_ids,
            loss_mask: loss_mask.into_iter().map(|m| m != 0).collect(),
        },
    })
}

impl DataSource for PluginDataSource {
    fn name(&self) -> String {
        self.label.clone()
    }

    fn examples(&mut self) -> Result<Vec<SourcedExample>> {
        let mut out = Vec::with_capacity(self.instance.len() as usize);
        for row in 0..self.instance.len() {
            let origin = Origin {
                file: self.label.clone(),
                row: row as usize,
            };
            let ex = self.instance.get(row)?;
            out.push(SourcedExample {
                example: to_raw(ex, &origin)?,
                origin,
            });
        }
        Ok(out)
    }
}

/// The dataset `data.plugin` names, one plugin instance per file of `files` (`data.train_files` or
/// `data.val_files`, `~/` expanded), tokenized like the built-in readers' examples.
pub fn plugin_dataset(
    host: &PluginHost,
    cfg: &DataConfig,
    files: &[String],
    tokenizer_dir: &Path,
    max_samples: i64,
) -> Result<SftDataset> {
    let name = cfg
        .plugin
        .as_deref()
        .ok_or_else(|| anyhow!("data.plugin is not set"))?;
    let tokenizer = SftTokenizer::from_dir(tokenizer_dir, cfg.chat_template.as_deref())?;
    let mut sources: Vec<Box<dyn DataSource>> = Vec::new();
    for f in files {
        let f = ferl_trainer::config::expand_path(f).display().to_string();
        let s = PluginDataSource::open(host, name, &dataset_config(&f, cfg))
            .with_context(|| format!("data.plugin={name}"))?;
        sources.push(Box::new(s));
    }
    SftDataset::from_sources(&mut sources, cfg, &tokenizer, max_samples)
}

/// `data.custom_cls.path=FILE` (a dataset plugin library) with optional `data.custom_cls.name=NAME` (its manifest
/// name): loads it into `host` unless a plugin of that name is loaded already, then sets `data.plugin` to it.
pub fn resolve_custom_cls(host: &PluginHost, cfg: &mut SftConfig) -> Result<()> {
    let Some(path) = cfg.data.custom_cls.path.clone() else {
        return Ok(());
    };
    let file = expand_path(&path);
    let wanted = cfg.data.custom_cls.name.clone();
    // Already loaded from that file (it sits in a watched folder too), or under the wanted name.
    let from_file = host
        .list()
        .into_iter()
        .find(|r| r.state == "current" && Path::new(&r.file) == file)
        .map(|r| r.name);
    let by_name = wanted
        .as_deref()
        .and_then(|n| host.get(n).map(|_| n.to_string()));
    let name = match from_file.or(by_name) {
        Some(loaded) => loaded,
        None => host
            .load_file(&file, Some(PluginKind::Dataset))
            .with_context(|| format!("data.custom_cls.path={path}"))?
            .info()
            .name
            .clone(),
    };
    if let Some(w) = &wanted {
        if *w != name {
            bail!("data.custom_cls.path={path} holds dataset plugin `{name}`, not data.custom_cls.name={w}");
        }
    }
    if let Some(p) = &cfg.data.plugin {
        if *p != name {
            bail!("data.plugin={p} and data.custom_cls (plugin `{name}`) name different datasets; set one");
        }
    }
    cfg.data.plugin = Some(name);
    cfg.data.custom_cls = Default::default();
    Ok(())
}
