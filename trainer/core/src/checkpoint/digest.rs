//! File digests of a checkpoint: `meta.json` records the size and CRC-32 of every other file of its
//! `global_step_N/` folder, and a load checks them first, so a corrupted or truncated checkpoint is refused naming
//! the file instead of loading garbage.

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};

/// What `meta.json` records of one file.
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileDigest {
    /// Length in bytes.
    pub bytes: u64,
    /// CRC-32 (IEEE) of the contents.
    pub crc32: u32,
}

/// The digest of the file at `path`, read in 4 MiB pieces.
pub fn digest_file(path: &Path) -> Result<FileDigest> {
    let mut file =
        std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let mut hasher = crc32fast::Hasher::new();
    let mut buf = vec![0u8; 4 << 20];
    let mut bytes = 0u64;
    loop {
        let n = file
            .read(&mut buf)
            .with_context(|| format!("reading {}", path.display()))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        bytes += n as u64;
    }
    Ok(FileDigest {
        bytes,
        crc32: hasher.finalize(),
    })
}

/// Every regular file below `dir` (relative paths with `/`), except `skip`, in name order.
fn files_below(dir: &Path, skip: &str) -> Result<Vec<String>> {
    let mut out = Vec::new();
    let mut stack = vec![PathBuf::new()];
    while let Some(rel) = stack.pop() {
        let here = dir.join(&rel);
        let entries =
            std::fs::read_dir(&here).with_context(|| format!("listing {}", here.display()))?;
        for entry in entries {
            let entry = entry.with_context(|| format!("listing {}", here.display()))?;
            let rel = rel.join(entry.file_name());
            if entry.file_type()?.is_dir() {
                stack.push(rel);
            } else {
                let name = rel.to_string_lossy().replace('\\', "/");
                if name != skip && !name.ends_with(".tmp") {
                    out.push(name);
                }
            }
        }
    }
    out.sort();
    Ok(out)
}

/// Digests of every file of the checkpoint folder `dir` except `meta_file`.
pub fn digest_dir(dir: &Path, meta_file: &str) -> Result<BTreeMap<String, FileDigest>> {
    files_below(dir, meta_file)?
        .into_iter()
        .map(|name| Ok((name.clone(), digest_file(&dir.join(&name))?)))
        .collect()
}

/// Checks every file `recorded` lists under `dir` (as `meta_file` recorded them); the error names the first missing,
/// truncated or corrupted file.
pub fn verify_dir(
    dir: &Path,
    recorded: &BTreeMap<String, FileDigest>,
    meta_file: &str,
) -> Result<()> {
    for (name, want) in recorded {
        let path = dir.join(name);
        if !path.is_file() {
            bail!("checkpoint file {} is missing", path.display());
        }
        let got = digest_file(&path)?;
        if got.bytes != want.bytes {
            bail!(
                "checkpoint file {} is truncated or overwritten: {} bytes, {meta_file} recorded {}",
                path.display(),
                got.bytes,
                want.bytes
            );
        }
        if got.crc32 != want.crc32 {
            bail!(
                "checkpoint file {} is corrupted: CRC-32 {:08x}, {meta_file} recorded {:08x}",
                path.display(),
                got.crc32,
                want.crc32
            );
        }
    }
    Ok(())
}
