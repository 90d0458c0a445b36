//! Content-addressed plugin files: the cache a node keeps of plugin files shipped from the driver.
//!
//! The runtime moves the bytes; this module names them by SHA-256, verifies what arrives and finds what a node
//! already has, so a plugin file travels to a node at most once.

use crate::library::sha256_hex;
use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};

/// A folder of plugin files named `SHA256.<dll suffix>`.
#[derive(Clone, Debug)]
pub struct PluginStore {
    dir: PathBuf,
}

impl PluginStore {
    /// The store in `dir` (created on first insert).
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self { dir: dir.into() }
    }

    /// Hex SHA-256 of a file's bytes: the id the driver announces and nodes look up.
    pub fn hash_file(path: &Path) -> Result<String> {
        let bytes = std::fs::read(path)
            .with_context(|| format!("cannot read plugin file {}", path.display()))?;
        Ok(sha256_hex(&bytes))
    }

    /// Where the file with hash `sha256` lives in this store.
    pub fn path_of(&self, sha256: &str) -> PathBuf {
        self.dir
            .join(format!("{sha256}{}", std::env::consts::DLL_SUFFIX))
    }

    /// The stored file with hash `sha256`, if present.
    pub fn get(&self, sha256: &str) -> Option<PathBuf> {
        let p = self.path_of(sha256);
        p.is_file().then_some(p)
    }

    /// Stores `bytes` that the sender announced as `sha256`; refuses them if they hash differently.
    pub fn insert_bytes(&self, sha256: &str, bytes: &[u8]) -> Result<PathBuf> {
        let got = sha256_hex(bytes);
        if got != sha256 {
            bail!("plugin bytes announced as {sha256} hash to {got}: refusing a corrupt or substituted file");
        }
        if let Some(p) = self.get(sha256) {
            return Ok(p);
        }
        std::fs::create_dir_all(&self.dir)
            .with_context(|| format!("cannot create plugin store {}", self.dir.display()))?;
        let p = self.path_of(sha256);
        let tmp = p.with_extension(format!("part{}", std::process::id()));
        std::fs::write(&tmp, bytes).with_context(|| format!("cannot write {}", tmp.display()))?;
        std::fs::rename(&tmp, &p)
            .with_context(|| format!("cannot move {} into place", tmp.display()))?;
        Ok(p)
    }

    /// Stores a local file; returns its hash and stored path.
    pub fn insert_file(&self, path: &Path) -> Result<(String, PathBuf)> {
        let bytes = std::fs::read(path)
            .with_context(|| format!("cannot read plugin file {}", path.display()))?;
        let h = sha256_hex(&bytes);
        let p = self.insert_bytes(&h, &bytes)?;
        Ok((h, p))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stores_by_hash_verifies_and_dedupes() {
        let dir = std::env::temp_dir().join(format!("ferl-store-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let store = PluginStore::new(&dir);
        let src = dir.with_extension("src");
        std::fs::write(&src, b"plugin bytes").unwrap();
        let (hash, path) = store.insert_file(&src).unwrap();
        assert_eq!(hash, PluginStore::hash_file(&src).unwrap());
        assert_eq!(store.get(&hash), Some(path.clone()));
        assert_eq!(std::fs::read(&path).unwrap(), b"plugin bytes");
        // The same bytes again: same file, nothing new.
        assert_eq!(store.insert_bytes(&hash, b"plugin bytes").unwrap(), path);
        // Bytes that do not match the announced hash are refused and not stored.
        let e = store
            .insert_bytes(&hash, b"tampered")
            .unwrap_err()
            .to_string();
        assert!(e.contains("refusing"), "{e}");
        assert!(store.get(&sha256_hex(b"tampered")).is_none());
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 1);
        std::fs::remove_dir_all(&dir).unwrap();
        std::fs::remove_file(&src).unwrap();
    }
}
