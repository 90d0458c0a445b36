//! Reading and writing model weights in the Hugging Face layout: `model.safetensors` or shards listed by
//! `model.safetensors.index.json`; random initialisation the way transformers' `_init_weights` does it.

use super::config::ModelConfig;
use super::layout::ModelLayout;
use anyhow::{bail, Context, Result};
use safetensors::tensor::{Dtype, Metadata, TensorView};
use std::collections::{BTreeMap, HashMap};
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use tch::{Kind, Tensor};

fn kind_of(dtype: Dtype) -> Option<Kind> {
    Some(match dtype {
        Dtype::F32 => Kind::Float,
        Dtype::BF16 => Kind::BFloat16,
        Dtype::F16 => Kind::Half,
        Dtype::F64 => Kind::Double,
        _ => return None,
    })
}

fn dtype_of(kind: Kind) -> Result<Dtype> {
    Ok(match kind {
        Kind::Float => Dtype::F32,
        Kind::BFloat16 => Dtype::BF16,
        Kind::Half => Dtype::F16,
        Kind::Double => Dtype::F64,
        Kind::Int64 => Dtype::I64,
        other => bail!("cannot store a {other:?} tensor in safetensors"),
    })
}

/// The safetensors files of a model folder: the shards named by the index, or `model.safetensors`.
pub fn weight_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let index = dir.join("model.safetensors.index.json");
    if index.exists() {
        let text = std::fs::read_to_string(&index)
            .with_context(|| format!("reading {}", index.display()))?;
        let v: serde_json::Value =
            serde_json::from_str(&text).with_context(|| format!("parsing {}", index.display()))?;
        let map = v
            .get("weight_map")
            .and_then(|m| m.as_object())
            .with_context(|| format!("{}: no `weight_map` object", index.display()))?;
        let mut files: Vec<String> = map
            .values()
            .filter_map(|f| f.as_str().map(String::from))
            .collect();
        files.sort();
        files.dedup();
        if let Some(bad) = files
            .iter()
            .find(|f| Path::new(f).file_name() != Some(std::ffi::OsStr::new(f.as_str())))
        {
            bail!(
                "{}: shard `{bad}` is not a file name in the model folder",
                index.display()
            );
        }
        return Ok(files.into_iter().map(|f| dir.join(f)).collect());
    }
    let single = dir.join("model.safetensors");
    if single.exists() {
        return Ok(vec![single]);
    }
    bail!(
        "{}: neither model.safetensors nor model.safetensors.index.json found",
        dir.display()
    )
}

/// Reads every tensor of `files` into fp32 CPU tensors keyed by name.
///
/// Each file is read tensor by tensor from its validated header ([`read_header`]), never whole, so the peak memory of
/// a load is the model's tensors plus one tensor's bytes (a 0.5B model's 2 GB file used to sit in memory beside the
/// tensors made from it, and set the peak resident memory of a LoRA run).
pub fn read_tensors(files: &[PathBuf]) -> Result<HashMap<String, Tensor>> {
    let mut out = HashMap::new();
    for file in files {
        let f = std::fs::File::open(file).with_context(|| format!("reading {}", file.display()))?;
        read_file_tensors(f, &mut out).with_context(|| format!("parsing {}", file.display()))?;
    }
    Ok(out)
}

/// Reads the tensors of the safetensors file `f` into `out`, in the order of their bytes in the file.
fn read_file_tensors(mut f: std::fs::File, out: &mut HashMap<String, Tensor>) -> Result<()> {
    let (data_start, meta) = read_header(&mut f)?;
    for name in meta.offset_keys() {
        let info = meta
            .info(&name)
            .context("header lists a tensor it has no entry for")?;
        let kind = kind_of(info.dtype)
            .with_context(|| format!("tensor `{name}` has unsupported dtype {:?}", info.dtype))?;
        let (start, end) = info.data_offsets;
        let mut bytes = vec![0u8; end - start];
        f.seek(SeekFrom::Start(data_start + start as u64))?;
        f.read_exact(&mut bytes)
            .with_context(|| format!("tensor `{name}`: reading its {} bytes", end - start))?;
        let view = TensorView::new(info.dtype, info.shape.clone(), &bytes)
            .with_context(|| format!("tensor `{name}`"))?;
        let t = tensor_of(&view, kind).with_context(|| format!("tensor `{name}`"))?;
        out.insert(name, t.to_kind(Kind::Float));
    }
    Ok(())
}

/// Largest header accepted, as the safetensors crate's own limit.
const MAX_HEADER_BYTES: u64 = 100_000_000;

/// Reads and validates a safetensors header (offsets contiguous, sizes matching shapes and dtypes, the data ending
/// where the file does); returns where the data starts and the header.
fn read_header(f: &mut std::fs::File) -> Result<(u64, Metadata)> {
    let file_len = f.metadata()?.len();
    let mut len = [0u8; 8];
    f.read_exact(&mut len)
        .context("shorter than a safetensors header")?;
    let n = u64::from_le_bytes(len);
    if n > MAX_HEADER_BYTES || 8 + n > file_len {
        bail!("header length {n} does not fit a {file_len}-byte file");
    }
    let mut header = vec![0u8; n as usize];
    f.read_exact(&mut header)?;
    let meta: Metadata = serde_json::from_slice(&header).context("parsing the header")?;
    let data_start = 8 + n;
    if data_start + meta.data_len() as u64 != file_len {
        bail!(
            "the header's tensors end at byte {} of the data, the file holds {}",
            meta.data_len(),
            file_len - data_start
        );
    }
    Ok((data_start, meta))
}

/// A CPU tensor holding `view`'s bytes; a dimension beyond `i64` (which libtorch refuses with a panic in tch) is an
/// error (found by fuzzing, `fuzz/corpus/trainer-safetensors/err-dimension-beyond-i64`).
fn tensor_of(view: &TensorView, kind: Kind) -> Result<Tensor> {
    let shape = view
        .shape()
        .iter()
        .map(|&d| {
            i64::try_from(d)
                .with_context(|| format!("dimension {d} of shape {:?} is too large", view.shape()))
        })
        .collect::<Result<Vec<i64>>>()?;
    Ok(Tensor::f_from_data_size(view.data(), &shape, kind)?)
}

/// One safetensors file opened to read parts of its tensors: the validated header only, no tensor data yet (a rank
/// that keeps a shard of the model reads only the bytes of its shard; design note 14).
pub struct SafetensorsFile {
    path: PathBuf,
    file: std::fs::File,
    data_start: u64,
    meta: Metadata,
    bytes_read: u64,
}

impl SafetensorsFile {
    /// Opens `path` and validates its header (offsets contiguous, sizes matching shapes, data ending with the file).
    pub fn open(path: &Path) -> Result<Self> {
        let mut file =
            std::fs::File::open(path).with_context(|| format!("reading {}", path.display()))?;
        let (data_start, meta) =
            read_header(&mut file).with_context(|| format!("parsing {}", path.display()))?;
        Ok(Self {
            path: path.to_path_buf(),
            file,
            data_start,
            meta,
            bytes_read: 0,
        })
    }

    /// Tensor bytes read so far (headers not counted).
    pub fn bytes_read(&self) -> u64 {
        self.bytes_read
    }

    /// The names of the file's tensors.
    pub fn names(&self) -> Vec<String> {
        self.meta.offset_keys()
    }

    /// The shape of tensor `name`, if the file holds it.
    pub fn shape(&self, name: &str) -> Option<Vec<i64>> {
        let info = self.meta.info(name)?;
        Some(info.shape.iter().map(|&d| d as i64).collect())
    }

    /// Elements `[lo, hi)` of tensor `name`, flattened in row-major order, as an fp32 CPU tensor; reads only their
    /// bytes from the file.
    pub fn read_range(&mut self, name: &str, lo: i64, hi: i64) -> Result<Tensor> {
        let path = self.path.display();
        let info = self
            .meta
            .info(name)
            .with_context(|| format!("{path}: tensor `{name}` missing"))?;
        let kind = kind_of(info.dtype).with_context(|| {
            format!(
                "{path}: tensor `{name}` has unsupported dtype {:?}",
                info.dtype
            )
        })?;
        let numel: usize = info.shape.iter().product();
        if lo < 0 || hi < lo || hi as usize > numel {
            bail!("{path}: elements [{lo}, {hi}) of tensor `{name}`, which has {numel}");
        }
        let size = (info.dtype.bitsize() / 8) as u64;
        let start = self.data_start + info.data_offsets.0 as u64 + lo as u64 * size;
        let mut bytes = vec![0u8; ((hi - lo) as u64 * size) as usize];
        self.file.seek(SeekFrom::Start(start))?;
        self.file
            .read_exact(&mut bytes)
            .with_context(|| format!("{path}: tensor `{name}`: reading elements [{lo}, {hi})"))?;
        self.bytes_read += bytes.len() as u64;
        Ok(Tensor::f_from_data_size(&bytes, &[hi - lo], kind)?.to_kind(Kind::Float))
    }
}

/// The tensors of a model folder's safetensors files, opened for reading parts of them ([`SafetensorsFile`]).
pub struct WeightReader {
    files: Vec<SafetensorsFile>,
    owner: HashMap<String, usize>,
}

impl WeightReader {
    /// Opens the weight files of the model folder `dir` ([`weight_files`]) and checks that every tensor of `layout` is
    /// there with its shape, and nothing the layout does not know besides (as [`load_params`] does).
    pub fn open(dir: &Path, layout: &ModelLayout) -> Result<Self> {
        let files = weight_files(dir)?
            .iter()
            .map(|p| SafetensorsFile::open(p))
            .collect::<Result<Vec<_>>>()?;
        let mut owner = HashMap::new();
        for (i, f) in files.iter().enumerate() {
            for name in f.names() {
                owner.insert(name, i);
            }
        }
        for (name, shape) in &layout.tensors {
            let found = owner.get(name).and_then(|&i| files[i].shape(name));
            match found {
                None => bail!(
                    "{}: tensor `{name}` missing from the safetensors files",
                    dir.display()
                ),
                Some(s) if s != *shape => bail!(
                    "{}: tensor `{name}` has shape {s:?}, config.json implies {shape:?}",
                    dir.display()
                ),
                Some(_) => {}
            }
        }
        let known = |k: &String| {
            layout.tensors.iter().any(|(n, _)| n == k)
                || k == "lm_head.weight"
                || k.contains("rotary_emb")
        };
        if let Some(extra) = owner.keys().find(|k| !known(k)) {
            bail!(
                "{}: unexpected tensor `{extra}` (not part of the model config.json describes)",
                dir.display()
            );
        }
        Ok(Self { files, owner })
    }

    /// Tensor bytes read so far from all files (headers not counted).
    pub fn bytes_read(&self) -> u64 {
        self.files.iter().map(SafetensorsFile::bytes_read).sum()
    }

    /// Elements `[lo, hi)` of tensor `name` flattened, fp32 on the CPU; reads only their bytes.
    pub fn read_range(&mut self, name: &str, lo: i64, hi: i64) -> Result<Tensor> {
        let i = *self
            .owner
            .get(name)
            .with_context(|| format!("tensor `{name}` missing from the safetensors files"))?;
        self.files[i].read_range(name, lo, hi)
    }
}

/// Loads the layout's tensors from the model folder `dir` as fp32, checking names and shapes.
pub fn load_params(dir: &Path, layout: &ModelLayout) -> Result<Vec<Tensor>> {
    let mut all = read_tensors(&weight_files(dir)?)?;
    let mut out = Vec::with_capacity(layout.tensors.len());
    for (name, shape) in &layout.tensors {
        let t = all.remove(name).with_context(|| {
            format!(
                "{}: tensor `{name}` missing from the safetensors files",
                dir.display()
            )
        })?;
        if t.size() != *shape {
            bail!(
                "{}: tensor `{name}` has shape {:?}, config.json implies {shape:?}",
                dir.display(),
                t.size()
            );
        }
        out.push(t);
    }
    all.remove("lm_head.weight"); // a tied model may still store a copy
    if let Some(extra) = all.keys().find(|k| !k.contains("rotary_emb")) {
        bail!(
            "{}: unexpected tensor `{extra}` (not part of the model config.json describes)",
            dir.display()
        );
    }
    Ok(out)
}

/// Random parameters as transformers initialises them: normal(0, initializer_range) for linear and embedding
/// weights, zeros for biases, ones for norms. Deterministic for a given `seed`.
pub fn init_params(cfg: &ModelConfig, layout: &ModelLayout, seed: i64) -> Vec<Tensor> {
    seeded(seed, || init_drawn(cfg, layout))
}

/// `draw()` with torch's global generator seeded with `seed`, under one process-wide lock: two threads seeding and
/// drawing at once (ranks as threads, tests run in parallel) would each draw the other's numbers.
pub fn seeded<T>(seed: i64, draw: impl FnOnce() -> T) -> T {
    static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    tch::manual_seed(seed);
    draw()
}

fn init_drawn(cfg: &ModelConfig, layout: &ModelLayout) -> Vec<Tensor> {
    let _guard = tch::no_grad_guard();
    layout
        .tensors
        .iter()
        .map(|(name, shape)| {
            if name.ends_with("norm.weight") {
                Tensor::ones(shape.as_slice(), (Kind::Float, tch::Device::Cpu))
            } else if name.ends_with(".bias") {
                Tensor::zeros(shape.as_slice(), (Kind::Float, tch::Device::Cpu))
            } else {
                Tensor::randn(shape.as_slice(), (Kind::Float, tch::Device::Cpu))
                    * cfg.initializer_range
            }
        })
        .collect()
}

/// Bytes of a contiguous CPU copy of `t`.
pub fn tensor_bytes(t: &Tensor) -> Vec<u8> {
    let t = t.to_device(tch::Device::Cpu).contiguous();
    let numel = t.numel();
    let mut buf = vec![0u8; numel * t.kind().elt_size_in_bytes()];
    t.copy_data_u8(&mut buf, numel);
    buf
}

/// Writes named tensors to one safetensors file with `{"format": "pt"}` metadata (what transformers expects).
pub fn write_safetensors(path: &Path, named: &[(String, Tensor)]) -> Result<()> {
    let mut bufs = Vec::with_capacity(named.len());
    for (name, t) in named {
        bufs.push((
            name.clone(),
            dtype_of(t.kind())?,
            t.size().iter().map(|&d| d as usize).collect::<Vec<_>>(),
            tensor_bytes(t),
        ));
    }
    let mut views = BTreeMap::new();
    for (name, dtype, shape, data) in &bufs {
        views.insert(
            name.clone(),
            TensorView::new(*dtype, shape.clone(), data)
                .with_context(|| format!("tensor `{name}`"))?,
        );
    }
    let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
    let tmp = path.with_extension("safetensors.tmp");
    safetensors::serialize_to_file(views, Some(meta), &tmp)
        .with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path)
        .with_context(|| format!("renaming {} to {}", tmp.display(), path.display()))?;
    Ok(())
}

/// Tokenizer and generation files copied from a source folder into an export, when present.
pub const SIDE_FILES: &[&str] = &[
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "generation_config.json",
    "chat_template.jinja",
];

/// Writes a Hugging Face folder: `config.json` (as read, dtype set), `model.safetensors` in `kind`, and the side files
/// found in `side_from`.
pub fn save_hf_folder(
    out: &Path,
    cfg: &ModelConfig,
    layout: &ModelLayout,
    params: &[Tensor],
    kind: Kind,
    side_from: &[&Path],
) -> Result<()> {
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let mut raw = cfg.raw.clone();
    let dtype = if kind == Kind::BFloat16 {
        "bfloat16"
    } else {
        "float32"
    };
    if let Some(obj) = raw.as_object_mut() {
        obj.insert("dtype".into(), dtype.into());
        if obj.contains_key("torch_dtype") {
            obj.insert("torch_dtype".into(), dtype.into());
        }
    }
    std::fs::write(out.join("config.json"), serde_json::to_string_pretty(&raw)?)
        .with_context(|| format!("writing {}/config.json", out.display()))?;
    let named: Vec<(String, Tensor)> = layout
        .tensors
        .iter()
        .zip(params)
        .map(|((n, _), t)| (n.clone(), t.to_kind(kind)))
        .collect();
    write_safetensors(&out.join("model.safetensors"), &named)?;
    copy_side_files(side_from, out)?;
    Ok(())
}

/// Copies each of [`SIDE_FILES`] from the first folder of `side_from` that has it into `out` (created when
/// needed); returns how many were copied.
pub fn copy_side_files(side_from: &[&Path], out: &Path) -> Result<usize> {
    let mut copied = 0;
    for file in SIDE_FILES {
        if let Some(src) = side_from.iter().map(|d| d.join(file)).find(|p| p.is_file()) {
            std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
            std::fs::copy(&src, out.join(file))
                .with_context(|| format!("copying {}", src.display()))?;
            copied += 1;
        }
    }
    Ok(copied)
}
