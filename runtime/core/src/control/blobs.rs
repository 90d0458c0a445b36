//! Files shipped with a spawn: a driver names files with [`crate::SpawnOptions::ship_file`]; before the node agent
//! starts the actor's worker it makes sure each one is in the node's content-addressed cache (fetching it from the
//! driver's file server (`binary.rs`) by sha256 when it is not), and tells the worker where each file is;
//! the actor finds them with `ferl_runtime::shipped_file` / `shipped_files` (read through [`shipped_files_in`]).
//!
//! The cache is `$FERL_BIN_CACHE/files` (default `~/.cache/ferl/bin/files`); a file is stored as
//! `SHA256` plus the extension of its driver-side name (`…/files/ab12….so`), so a file travels to a node at most
//! once, whatever name or path it has on the driver. Nothing here knows what the files are.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context as _, Result};
use sha2::{Digest, Sha256};

use crate::actor::process::{Process, BINARY_ACTOR};
use crate::control::binary::{FetchFileChunk, FILE_CHUNK_BYTES};

/// Environment variable a worker finds its shipped files in (a JSON object: name → local path).
pub const SHIPPED_FILES_ENV: &str = "FERL_SHIPPED_FILES";

pub(crate) use crate::protocol::ShippedFile;

/// Checks that `digest`, received from a peer, is a sha256 in hex (64 lowercase hex digits) before it names a file.
pub(crate) fn check_sha256_hex(digest: &str) -> Result<()> {
    let ok = digest.len() == 64
        && digest
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
    if !ok {
        bail!(
            "`{}` is not a sha256 digest (64 lowercase hex digits)",
            digest.escape_debug()
        );
    }
    Ok(())
}

/// Where the file with hash `sha256` and driver-side name `file_name` lives in the cache folder `dir`.
pub(crate) fn cache_path(dir: &Path, sha256: &str, file_name: &str) -> PathBuf {
    let ext = Path::new(file_name)
        .extension()
        .map(|e| format!(".{}", e.to_string_lossy()))
        .unwrap_or_default();
    dir.join(format!("{sha256}{ext}"))
}

/// The files folder of a node whose binary cache is `bin_cache`.
pub(crate) fn files_dir(bin_cache: &Path) -> PathBuf {
    bin_cache.join("files")
}

/// Makes sure every file of `files` is in the cache under `bin_cache` (fetching what is missing from its driver)
/// and returns the worker environment that lists them (nothing when `files` is empty).
pub(crate) async fn materialise(
    process: &Arc<Process>,
    bin_cache: &Path,
    files: &[ShippedFile],
) -> Result<Vec<(String, String)>> {
    if files.is_empty() {
        return Ok(Vec::new());
    }
    // One fetch at a time per node process: two workers starting together share the first one's transfer.
    static FETCH: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    let dir = files_dir(bin_cache);
    let mut listed = BTreeMap::new();
    for f in files {
        check_sha256_hex(&f.sha256).with_context(|| format!("shipped file `{}`", f.name))?;
        let path = cache_path(&dir, &f.sha256, &f.file_name);
        if !path.is_file() {
            let _guard = FETCH.lock().await;
            if !path.is_file() {
                fetch(process, f, &path).await.with_context(|| {
                    format!(
                        "shipping `{}` ({}) from the driver at {}",
                        f.name, f.driver_path, f.server
                    )
                })?;
            }
        }
        listed.insert(f.name.clone(), path.display().to_string());
    }
    Ok(vec![(
        SHIPPED_FILES_ENV.to_string(),
        serde_json::to_string(&listed)?,
    )])
}

async fn fetch(process: &Arc<Process>, f: &ShippedFile, dest: &Path) -> Result<()> {
    let server: SocketAddr = f
        .server
        .parse()
        .with_context(|| format!("file server address `{}`", f.server))?;
    let mut bytes = Vec::with_capacity(f.size as usize);
    while (bytes.len() as u64) < f.size {
        let offset = bytes.len() as u64;
        let chunk = process
            .call_at(
                server,
                BINARY_ACTOR,
                &FetchFileChunk {
                    sha256: f.sha256.clone(),
                    offset,
                    len: (f.size - offset).min(FILE_CHUNK_BYTES),
                },
            )
            .await?;
        if chunk.is_empty() {
            bail!("the driver's copy ended at byte {offset} of {}", f.size);
        }
        bytes.extend_from_slice(&chunk);
    }
    store_verified(dest, &f.sha256, &bytes)?;
    tracing::info!(
        name = %f.name,
        sha256 = %f.sha256,
        bytes = f.size,
        path = %dest.display(),
        "fetched a shipped file"
    );
    Ok(())
}

/// Writes `bytes` to `dest` (atomically, by rename) after checking they hash to `sha256`.
pub(crate) fn store_verified(dest: &Path, sha256: &str, bytes: &[u8]) -> Result<()> {
    let got = hex::encode(Sha256::digest(bytes));
    if got != sha256 {
        bail!("received bytes hash to {got}, not the announced {sha256}: refusing them");
    }
    let dir = dest.parent().context("cache path has a folder")?;
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let tmp = dir.join(format!(".{sha256}.{}.part", std::process::id()));
    std::fs::write(&tmp, bytes).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, dest).with_context(|| format!("moving {} into place", tmp.display()))?;
    Ok(())
}

/// The files a worker's [`SHIPPED_FILES_ENV`] value lists, name → local path (empty when `listing` is `None`); the
/// bootstrap layer reads the variable (`shipped_files` in the facade).
pub(crate) fn shipped_files_in(listing: Option<String>) -> Result<BTreeMap<String, PathBuf>> {
    match listing {
        Some(v) => parse_listing(&v),
        None => Ok(BTreeMap::new()),
    }
}

fn parse_listing(v: &str) -> Result<BTreeMap<String, PathBuf>> {
    let m: BTreeMap<String, String> = serde_json::from_str(v)
        .with_context(|| format!("{SHIPPED_FILES_ENV} is not a JSON object of paths: `{v}`"))?;
    Ok(m.into_iter().map(|(k, p)| (k, PathBuf::from(p))).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_keeps_the_extension_and_names_by_hash() {
        let d = Path::new("/c");
        assert_eq!(cache_path(d, "ab", "libx.so"), PathBuf::from("/c/ab.so"));
        let good = "0123456789abcdef".repeat(4);
        assert!(check_sha256_hex(&good).is_ok());
        for bad in [
            "../../etc/passwd",
            "ab",
            &good.to_uppercase(),
            &format!("{}/x", &good[..62]),
        ] {
            let err = check_sha256_hex(bad).unwrap_err().to_string();
            assert!(err.contains("not a sha256"), "{bad}: {err}");
        }
        assert_eq!(cache_path(d, "ab", "data"), PathBuf::from("/c/ab"));
    }

    #[test]
    fn stores_only_bytes_that_match_their_hash() {
        let dir = tempfile::tempdir().unwrap();
        let bytes = b"shipped bytes";
        let sha = hex::encode(Sha256::digest(bytes));
        let dest = cache_path(dir.path(), &sha, "f.so");
        let e = store_verified(&dest, &sha, b"other bytes").unwrap_err();
        assert!(e.to_string().contains("refusing"), "{e}");
        assert!(!dest.exists());
        store_verified(&dest, &sha, bytes).unwrap();
        assert_eq!(std::fs::read(&dest).unwrap(), bytes);
        // Only the stored file remains (no temporary left behind).
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    #[test]
    fn listing_round_trips_and_rejects_garbage() {
        let mut m = BTreeMap::new();
        m.insert("plugin:a".to_string(), "/x/a.so".to_string());
        let v = serde_json::to_string(&m).unwrap();
        let got = parse_listing(&v).unwrap();
        assert_eq!(got["plugin:a"], PathBuf::from("/x/a.so"));
        let e = parse_listing("nope").unwrap_err().to_string();
        assert!(e.contains(SHIPPED_FILES_ENV), "{e}");
    }
}
