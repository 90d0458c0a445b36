//! `model.partial_pretrain` as a local folder or a Hugging Face Hub id, resolved as `transformers` resolves
//! `from_pretrained(name)`:
//!
//! 1. A path that exists (after `~/` expansion) is the model folder, as given.
//! 2. Else a repo id `ORG/NAME` (or a legacy `NAME`), optionally `ORG/NAME@REVISION`, is looked up in the Hugging
//!    Face cache (`$HF_HUB_CACHE`, else `$HF_HOME/hub`, else `~/.cache/huggingface/hub`): `models--ORG--NAME/refs/
//!    <revision>` (default `main`) holds a commit hash and `snapshots/<hash>/` is the folder; a revision that is itself
//!    a commit hash present under `snapshots/` is used directly. A snapshot with `config.json` and its safetensors
//!    weights is used without contacting any host.
//! 3. Else, unless `HF_HUB_OFFLINE` (or, as `huggingface_hub` does, `TRANSFORMERS_OFFLINE`) is true, the files a
//!    model needs are downloaded from `$HF_ENDPOINT` (default `https://huggingface.co`) into that cache, in the
//!    layout `huggingface_hub` writes (blobs, snapshot symlinks, `refs/<revision>`), so Python tools and ferl share
//!    one cache: `config.json`, the safetensors weights (`model.safetensors`, or `model.safetensors.index.json` and
//!    the shards it names), and the tokenizer and generation files of [`super::weights::SIDE_FILES`] the repo has.
//!    The revision is first resolved to one commit (the repo info API) and every file is fetched at that commit.
//! 4. A model found nowhere is one error naming the id, every place looked at and, offline, that offline mode is on.
//!
//! The revision is written `ORG/NAME@REVISION` (a branch, tag or commit hash) rather than a new config key: verl's
//! SFT config has no revision key, so a `model.revision` would be a ferl-only key in a verl-compatible config, while
//! `@` can appear in no Hub repo id and keeps the whole choice in the one verl key.
//!
//! Cluster nodes: every process that reads the model folder (the coordinator, launcher ranks, the data loader and
//! trainer-rank actors) resolves the spec itself with its own environment, so each node uses its own Hugging Face
//! cache, as `transformers` does under torchrun. Nodes sharing no file system then need no copy step, and nodes that
//! do share one (an NFS `HF_HOME`) download once: a download holds an exclusive lock in the cache's `.locks/` folder
//! and re-checks the cache once it has it, so concurrent ranks wait for the first one instead of racing. The
//! coordinator resolves before anything is spawned, so a missing model fails the launch early.
//!
//! The download uses the `hf-hub` crate's blocking client (ureq), with its per-file progress bars.

use std::collections::BTreeSet;
use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use hf_hub::api::sync::{Api, ApiBuilder, ApiRepo};
use hf_hub::{Cache, Repo, RepoType};

/// The Hub contacted when `HF_ENDPOINT` is not set.
pub const DEFAULT_ENDPOINT: &str = "https://huggingface.co";

/// Where and how models named by Hub id are found: the environment's settings, explicit so tests need not touch the
/// process environment ([`HubSettings::from_env`] reads them as `huggingface_hub` does).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HubSettings {
    /// The hub cache folder (holding `models--ORG--NAME/`).
    pub cache_dir: PathBuf,
    /// The Hub's base URL, without a trailing `/`.
    pub endpoint: String,
    /// Never download (`HF_HUB_OFFLINE`).
    pub offline: bool,
    /// The access token sent to the Hub, if any (`HF_TOKEN` or the token file).
    pub token: Option<String>,
    /// Show per-file download progress bars.
    pub progress: bool,
}

impl HubSettings {
    /// The settings of this process's environment (see [`HubSettings::from_vars`]).
    pub fn from_env() -> Self {
        Self::from_vars(|name| std::env::var(name).ok())
    }

    /// The settings from the variables `var` returns (empty values count as unset), as `huggingface_hub` reads them:
    /// `HF_HOME` (else `$XDG_CACHE_HOME/huggingface`, else `~/.cache/huggingface`); `HF_HUB_CACHE` (or the legacy
    /// `HUGGINGFACE_HUB_CACHE`, else `$HF_HOME/hub`); `HF_ENDPOINT`; `HF_HUB_OFFLINE` (else `TRANSFORMERS_OFFLINE`),
    /// true for `1`, `ON`, `YES` or `TRUE` in any case; `HF_TOKEN` (or the legacy `HUGGING_FACE_HUB_TOKEN`), else the
    /// file `HF_TOKEN_PATH` or `$HF_HOME/token`. A leading `~/` in a path is expanded with `HOME`.
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Self {
        let get = |name: &str| var(name).filter(|v| !v.trim().is_empty());
        let home = get("HOME");
        let path = |v: String| match (v.strip_prefix("~/"), &home) {
            (Some(rest), Some(h)) => Path::new(h).join(rest),
            _ => PathBuf::from(v),
        };
        let hf_home = get("HF_HOME").map(path).unwrap_or_else(|| {
            let cache = get("XDG_CACHE_HOME")
                .map(path)
                .unwrap_or_else(|| path("~/.cache".into()));
            cache.join("huggingface")
        });
        let cache_dir = get("HF_HUB_CACHE")
            .or_else(|| get("HUGGINGFACE_HUB_CACHE"))
            .map(path)
            .unwrap_or_else(|| hf_home.join("hub"));
        let endpoint = get("HF_ENDPOINT")
            .map(|e| e.trim().trim_end_matches('/').to_string())
            .unwrap_or_else(|| DEFAULT_ENDPOINT.to_string());
        let offline = get("HF_HUB_OFFLINE")
            .or_else(|| get("TRANSFORMERS_OFFLINE"))
            .is_some_and(|v| {
                matches!(
                    v.trim().to_ascii_uppercase().as_str(),
                    "1" | "ON" | "YES" | "TRUE"
                )
            });
        let token = get("HF_TOKEN")
            .or_else(|| get("HUGGING_FACE_HUB_TOKEN"))
            .or_else(|| {
                let file = get("HF_TOKEN_PATH")
                    .map(path)
                    .unwrap_or_else(|| hf_home.join("token"));
                std::fs::read_to_string(file).ok()
            })
            .map(|t| t.trim().to_string())
            .filter(|t| !t.is_empty());
        Self {
            cache_dir,
            endpoint,
            offline,
            token,
            progress: true,
        }
    }
}

/// A model repo on the Hub and the revision asked for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RepoRef {
    /// `ORG/NAME` (or a legacy single `NAME`).
    pub id: String,
    /// A branch, tag or commit hash (`main` unless given as `ORG/NAME@REVISION`).
    pub revision: String,
}

impl RepoRef {
    /// `ORG/NAME` or `ORG/NAME@REVISION` when `spec` is a valid Hub repo id (the rules of `huggingface_hub`'s
    /// `validate_repo_id`: at most one `/`, parts of letters, digits, `_`, `-` and `.` that begin and end with a
    /// letter, digit or `_`, no `--` or `..`, at most 96 characters) and a safe revision; else `None`.
    pub fn parse(spec: &str) -> Option<Self> {
        let (id, revision) = match spec.split_once('@') {
            Some((id, rev)) => (id, rev),
            None => (spec, "main"),
        };
        (valid_repo_id(id) && valid_revision(revision)).then(|| Self {
            id: id.to_string(),
            revision: revision.to_string(),
        })
    }

    /// The repo's folder in the hub cache: `models--ORG--NAME`.
    pub fn folder_name(&self) -> String {
        format!("models--{}", self.id.replace('/', "--"))
    }
}

fn valid_repo_id(id: &str) -> bool {
    let word = |c: char| c.is_ascii_alphanumeric() || c == '_';
    let part_ok = |p: &str| {
        !p.is_empty()
            && p.chars().all(|c| word(c) || c == '-' || c == '.')
            && p.starts_with(word)
            && p.ends_with(word)
    };
    let parts: Vec<&str> = id.split('/').collect();
    id.len() <= 96
        && parts.len() <= 2
        && parts.iter().all(|p| part_ok(p))
        && !id.contains("--")
        && !id.contains("..")
        && !id.ends_with(".git")
}

fn valid_revision(rev: &str) -> bool {
    !rev.is_empty()
        && !rev.starts_with('/')
        && rev
            .chars()
            .all(|c| !c.is_control() && !c.is_whitespace() && c != '\\')
        && rev
            .split('/')
            .all(|p| !p.is_empty() && p != "." && p != "..")
}

/// Whether `s` is a full git commit hash (40 lowercase hex digits).
pub fn is_commit_hash(s: &str) -> bool {
    s.len() == 40 && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// The model folder `spec` names, with the settings of this process's environment ([`resolve_model_with`]).
pub fn resolve_model(spec: &str) -> Result<PathBuf> {
    resolve_model_with(spec, &HubSettings::from_env())
}

/// The model folder `spec` names: an existing local path (after `~/` expansion) as given, else a Hub repo id's
/// snapshot in `settings.cache_dir`, downloaded there first when absent and not offline (see the module doc).
pub fn resolve_model_with(spec: &str, settings: &HubSettings) -> Result<PathBuf> {
    let local = ferl_config::expand_path(spec);
    if local.exists() {
        return Ok(local);
    }
    let shown = std::env::current_dir()
        .map(|cwd| cwd.join(&local))
        .unwrap_or_else(|_| local.clone());
    let Some(repo) = RepoRef::parse(spec) else {
        bail!(
            "model `{spec}` not found: no folder {} (and `{spec}` is not a Hugging Face repo id ORG/NAME[@REVISION] \
             to look up in the cache {})",
            shown.display(),
            settings.cache_dir.display()
        );
    };
    let repo_dir = settings.cache_dir.join(repo.folder_name());
    let why = match lookup_cache(&repo, &settings.cache_dir) {
        Cached::Complete(dir) => return Ok(dir),
        Cached::NoWeights(dir) if settings.offline => {
            tracing::warn!(
                "{}: the cached snapshot {} has no safetensors weights and HF_HUB_OFFLINE is set",
                repo.id,
                dir.display()
            );
            return Ok(dir);
        }
        Cached::NoWeights(dir) => format!("{} has no safetensors weights", dir.display()),
        Cached::Missing(why) => why,
    };
    let not_found = format!(
        "model `{}` (revision `{}`) not found: no local folder {}, and not in the Hugging Face cache {} ({why})",
        repo.id,
        repo.revision,
        shown.display(),
        repo_dir.display()
    );
    if settings.offline {
        bail!(
            "{not_found}; HF_HUB_OFFLINE is set (offline mode), so it was not downloaded from {}",
            settings.endpoint
        );
    }
    download(&repo, settings).with_context(|| {
        format!(
            "{not_found}; downloading it from {} failed",
            settings.endpoint
        )
    })
}

/// What the cache holds for a repo and revision.
#[derive(Debug, PartialEq, Eq)]
enum Cached {
    /// A snapshot with `config.json` and its weights.
    Complete(PathBuf),
    /// A snapshot with `config.json` but no safetensors weights (e.g. only a tokenizer was fetched).
    NoWeights(PathBuf),
    /// No usable snapshot, and why.
    Missing(String),
}

fn lookup_cache(repo: &RepoRef, cache_dir: &Path) -> Cached {
    let dir = cache_dir.join(repo.folder_name());
    let ref_file = dir.join("refs").join(&repo.revision);
    let hash = match std::fs::read_to_string(&ref_file) {
        Ok(h) if !h.trim().is_empty() && h.trim().chars().all(|c| c.is_ascii_alphanumeric()) => {
            h.trim().to_string()
        }
        Ok(_) => return Cached::Missing(format!("{} is empty or invalid", ref_file.display())),
        Err(_) if is_commit_hash(&repo.revision) => repo.revision.clone(),
        Err(_) => return Cached::Missing(format!("no refs/{}", repo.revision)),
    };
    let snapshot = dir.join("snapshots").join(&hash);
    if !snapshot.join("config.json").is_file() {
        let what = if snapshot.is_dir() {
            "has no config.json"
        } else {
            "is absent"
        };
        return Cached::Missing(format!("snapshots/{hash} {what}"));
    }
    let weights = snapshot.join("model.safetensors").is_file() || snapshot.join(INDEX).is_file();
    if weights {
        Cached::Complete(snapshot)
    } else {
        Cached::NoWeights(snapshot)
    }
}

const INDEX: &str = "model.safetensors.index.json";

/// The files to fetch from a repo listing `files`: `config.json`, the weights (the index when the repo has one,
/// else `model.safetensors`) and the side files present. Only top-level files: other formats and duplicates in
/// subfolders or e.g. `consolidated.safetensors` are never fetched. The index's shards come after it is read.
fn files_to_fetch(files: &BTreeSet<String>) -> Result<Vec<String>> {
    if !files.contains("config.json") {
        bail!("the repo has no config.json (not a transformers model)");
    }
    let weights = if files.contains(INDEX) {
        INDEX
    } else if files.contains("model.safetensors") {
        "model.safetensors"
    } else {
        let listed: Vec<&str> = files.iter().map(String::as_str).take(20).collect();
        bail!(
            "the repo has neither model.safetensors nor {INDEX} (ferl reads safetensors weights only); it lists: {}",
            listed.join(", ")
        );
    };
    let mut out = vec!["config.json".to_string()];
    out.extend(
        super::weights::SIDE_FILES
            .iter()
            .filter(|f| files.contains(**f))
            .map(|f| f.to_string()),
    );
    out.push(weights.to_string());
    Ok(out)
}

/// The shard files a `model.safetensors.index.json` names, each once, in order.
fn index_shards(index: &Path) -> Result<Vec<String>> {
    let text =
        std::fs::read_to_string(index).with_context(|| format!("reading {}", index.display()))?;
    let json: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("parsing {}", index.display()))?;
    let map = json["weight_map"]
        .as_object()
        .with_context(|| format!("{}: no `weight_map` object", index.display()))?;
    let mut shards = BTreeSet::new();
    for file in map.values() {
        let f = file
            .as_str()
            .with_context(|| format!("{}: a weight_map value is not a string", index.display()))?;
        if !valid_revision(f) || f.contains('@') {
            bail!("{}: invalid shard file name `{f}`", index.display());
        }
        shards.insert(f.to_string());
    }
    Ok(shards.into_iter().collect())
}

/// An exclusive `flock` held until dropped (closing the file releases it).
struct FileLock {
    _file: File,
}

fn lock_exclusive(path: &Path, what: &str) -> Result<FileLock> {
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent)
            .with_context(|| format!("creating {}", parent.display()))?;
    }
    let file = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)
        .with_context(|| format!("opening the lock file {}", path.display()))?;
    let fd = file.as_raw_fd();
    // SAFETY: `fd` is an open descriptor owned by `file`, alive for both calls.
    if unsafe { libc::flock(fd, libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        tracing::info!(
            "waiting for another process downloading {what} (lock {})",
            path.display()
        );
        loop {
            // SAFETY: as above.
            if unsafe { libc::flock(fd, libc::LOCK_EX) } == 0 {
                break;
            }
            let err = std::io::Error::last_os_error();
            if err.kind() != std::io::ErrorKind::Interrupted {
                return Err(err).with_context(|| format!("locking {}", path.display()));
            }
        }
    }
    Ok(FileLock { _file: file })
}

/// Downloads `repo` at its revision's current commit into the cache and returns the snapshot folder.
fn download(repo: &RepoRef, s: &HubSettings) -> Result<PathBuf> {
    let repo_dir = s.cache_dir.join(repo.folder_name());
    let lock = s
        .cache_dir
        .join(".locks")
        .join(repo.folder_name())
        .join("ferl-snapshot.lock");
    let _lock = lock_exclusive(&lock, &repo.id)?;
    // Another process may have completed it while this one waited for the lock.
    if let Cached::Complete(dir) = lookup_cache(repo, &s.cache_dir) {
        return Ok(dir);
    }
    let api = ApiBuilder::from_cache(Cache::new(s.cache_dir.clone()))
        .with_endpoint(s.endpoint.clone())
        .with_token(s.token.clone())
        .with_progress(s.progress)
        .with_retries(3)
        .build()
        .context("setting up the Hub client")?;
    let (sha, files) = current_commit(&api, repo)?;
    let mut wanted = files_to_fetch(&files)?;
    tracing::info!(
        "downloading {}@{} (commit {sha}) from {} into {}",
        repo.id,
        repo.revision,
        s.endpoint,
        repo_dir.display()
    );
    // Every file at the one commit the revision named when listed, even if the branch moves meanwhile.
    let pinned = api.repo(Repo::with_revision(
        repo.id.clone(),
        RepoType::Model,
        sha.clone(),
    ));
    let snapshot = repo_dir.join("snapshots").join(&sha);
    let sha_ref = repo_dir.join("refs").join(&sha);
    let had_sha_ref = sha_ref.exists();
    fetch_all(&pinned, &snapshot, &sha, &mut wanted)?;
    if repo.revision != sha {
        write_ref(&repo_dir.join("refs").join(&repo.revision), &sha)?;
        if !had_sha_ref {
            // hf-hub records a ref named after the pinned commit; huggingface_hub writes none for a commit.
            std::fs::remove_file(&sha_ref).ok();
        }
    }
    tracing::info!(
        "{}@{}: {} files in {}",
        repo.id,
        repo.revision,
        wanted.len(),
        snapshot.display()
    );
    Ok(snapshot)
}

/// The commit `repo`'s revision names now on the Hub (checked to be a plain hash) and the files of the repo.
fn current_commit(api: &Api, repo: &RepoRef) -> Result<(String, BTreeSet<String>)> {
    let info = api
        .repo(Repo::with_revision(
            repo.id.clone(),
            RepoType::Model,
            repo.revision.clone(),
        ))
        .info()
        .map_err(hub_error)
        .with_context(|| format!("reading the file list of {}@{}", repo.id, repo.revision))?;
    let sha = info.sha;
    if sha.is_empty() || !sha.chars().all(|c| c.is_ascii_alphanumeric()) {
        bail!(
            "the Hub answered an invalid commit `{sha}` for {}@{}",
            repo.id,
            repo.revision
        );
    }
    let files = info.siblings.into_iter().map(|s| s.rfilename).collect();
    Ok((sha, files))
}

/// Downloads each of `wanted` from `pinned` (the repo at commit `sha`) into `snapshot`, skipping files already
/// there; the shards a downloaded weight index names are appended to `wanted` and fetched too.
fn fetch_all(pinned: &ApiRepo, snapshot: &Path, sha: &str, wanted: &mut Vec<String>) -> Result<()> {
    let fetch = |name: &str| -> Result<()> {
        let want = snapshot.join(name);
        if want.is_file() {
            return Ok(());
        }
        let got = pinned
            .download(name)
            .map_err(hub_error)
            .with_context(|| format!("downloading {name}"))?;
        if got != want {
            bail!(
                "downloading {name}: the Hub served commit {} instead of {sha}",
                got.display()
            );
        }
        Ok(())
    };
    let mut i = 0;
    while i < wanted.len() {
        fetch(&wanted[i])?;
        if wanted[i] == INDEX {
            wanted.extend(index_shards(&snapshot.join(INDEX))?);
        }
        i += 1;
    }
    Ok(())
}

/// An hf-hub error as one message (its `Display` already includes its source), with a hint for refused access.
fn hub_error(e: hf_hub::api::sync::ApiError) -> anyhow::Error {
    let text = e.to_string();
    if text.contains("status code 401") || text.contains("status code 403") {
        anyhow::anyhow!(
            "{text} (a private or gated repo needs an access token: set HF_TOKEN or log in with `hf auth login`)"
        )
    } else {
        anyhow::anyhow!(text)
    }
}

/// Writes `refs/<revision>` (replaced atomically: concurrent readers see the old or the new hash).
fn write_ref(path: &Path, sha: &str) -> Result<()> {
    let parent = path.parent().context("a ref has a parent folder")?;
    std::fs::create_dir_all(parent).with_context(|| format!("creating {}", parent.display()))?;
    let tmp = parent.join(format!(
        ".{}.ferl-tmp-{}",
        path.file_name().unwrap_or_default().to_string_lossy(),
        std::process::id()
    ));
    std::fs::write(&tmp, sha).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("writing {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    const HASH: &str = "0123456789abcdef0123456789abcdef01234567";
    const OTHER: &str = "89abcdef0123456789abcdef0123456789abcdef";

    fn settings(cache: &Path, offline: bool) -> HubSettings {
        HubSettings {
            cache_dir: cache.to_path_buf(),
            // Nothing listens there: a test that reached the network would fail, not hang.
            endpoint: "http://127.0.0.1:9".into(),
            offline,
            token: None,
            progress: false,
        }
    }

    /// `models--ORG--NAME/snapshots/<hash>/` with config.json and weights, and `refs/<r>` → hash for each ref.
    fn snapshot(cache: &Path, id: &str, hash: &str, refs: &[&str]) -> PathBuf {
        let repo = cache.join(format!("models--{}", id.replace('/', "--")));
        let snap = repo.join("snapshots").join(hash);
        std::fs::create_dir_all(&snap).unwrap();
        std::fs::write(snap.join("config.json"), "{}").unwrap();
        std::fs::write(snap.join("model.safetensors"), "w").unwrap();
        for r in refs {
            let f = repo.join("refs").join(r);
            std::fs::create_dir_all(f.parent().unwrap()).unwrap();
            std::fs::write(f, hash).unwrap();
        }
        snap
    }

    #[test]
    fn repo_ids_and_revisions_parse_like_huggingface_hub() {
        let r = RepoRef::parse("Qwen/Qwen2.5-0.5B").unwrap();
        assert_eq!(
            (r.id.as_str(), r.revision.as_str()),
            ("Qwen/Qwen2.5-0.5B", "main")
        );
        assert_eq!(r.folder_name(), "models--Qwen--Qwen2.5-0.5B");
        let r = RepoRef::parse("org/name@refs/pr/1").unwrap();
        assert_eq!(
            (r.id.as_str(), r.revision.as_str()),
            ("org/name", "refs/pr/1")
        );
        assert_eq!(RepoRef::parse("gpt2").unwrap().id, "gpt2");
        for bad in [
            "/abs/path",
            "./rel",
            "~/models/x",
            "a/b/c",
            "org/-name",
            "org/name.",
            "org--x/y",
            "a/b..c",
            "org/name.git",
            "org/name@",
            "org/name@../x",
            "org/name@a b",
            "",
            "org/",
        ] {
            assert_eq!(RepoRef::parse(bad), None, "{bad}");
        }
        assert!(is_commit_hash(HASH) && !is_commit_hash("main") && !is_commit_hash(&HASH[1..]));
    }

    #[test]
    fn settings_follow_the_huggingface_variables() {
        let vars = |pairs: &[(&str, &str)]| {
            let m: HashMap<String, String> = pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            HubSettings::from_vars(move |k| m.get(k).cloned())
        };
        let s = vars(&[("HOME", "/h")]);
        assert_eq!(s.cache_dir, Path::new("/h/.cache/huggingface/hub"));
        assert_eq!(s.endpoint, DEFAULT_ENDPOINT);
        assert!(!s.offline && s.token.is_none());
        let s = vars(&[("HOME", "/h"), ("XDG_CACHE_HOME", "/x")]);
        assert_eq!(s.cache_dir, Path::new("/x/huggingface/hub"));
        let s = vars(&[
            ("HOME", "/h"),
            ("HF_HOME", "~/hf"),
            ("HF_ENDPOINT", "http://127.0.0.1:1/"),
        ]);
        assert_eq!(s.cache_dir, Path::new("/h/hf/hub"));
        assert_eq!(s.endpoint, "http://127.0.0.1:1");
        let s = vars(&[
            ("HF_HOME", "/hf"),
            ("HF_HUB_CACHE", "/c"),
            ("HF_HUB_OFFLINE", "true"),
        ]);
        assert_eq!(s.cache_dir, Path::new("/c"));
        assert!(s.offline);
        assert!(vars(&[("HF_HUB_OFFLINE", "1")]).offline);
        assert!(vars(&[("TRANSFORMERS_OFFLINE", "yes")]).offline);
        assert!(!vars(&[("HF_HUB_OFFLINE", "0"), ("TRANSFORMERS_OFFLINE", "1")]).offline);
        assert!(!vars(&[("HF_HUB_OFFLINE", "")]).offline);
        assert_eq!(vars(&[("HF_TOKEN", " t \n")]).token.as_deref(), Some("t"));
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("token"), "hf_file\n").unwrap();
        let home = dir.path().to_str().unwrap();
        assert_eq!(vars(&[("HF_HOME", home)]).token.as_deref(), Some("hf_file"));
    }

    #[test]
    fn a_cached_repo_resolves_to_its_snapshot_for_main_a_ref_and_a_commit_hash() {
        let cache = tempfile::tempdir().unwrap();
        let main = snapshot(cache.path(), "org/name", HASH, &["main"]);
        let tagged = snapshot(cache.path(), "org/name", OTHER, &["v1.0", "refs/pr/1"]);
        for offline in [true, false] {
            let s = settings(cache.path(), offline);
            assert_eq!(resolve_model_with("org/name", &s).unwrap(), main);
            assert_eq!(resolve_model_with("org/name@main", &s).unwrap(), main);
            assert_eq!(resolve_model_with("org/name@v1.0", &s).unwrap(), tagged);
            assert_eq!(
                resolve_model_with("org/name@refs/pr/1", &s).unwrap(),
                tagged
            );
            assert_eq!(
                resolve_model_with(&format!("org/name@{OTHER}"), &s).unwrap(),
                tagged
            );
        }
        // A legacy id without an org.
        let legacy = snapshot(cache.path(), "gpt2", HASH, &["main"]);
        assert_eq!(
            resolve_model_with("gpt2", &settings(cache.path(), true)).unwrap(),
            legacy
        );
    }

    #[test]
    fn a_local_folder_wins_over_the_cache() {
        let cache = tempfile::tempdir().unwrap();
        // `ORG/NAME` relative to the working directory, which is also a valid id cached under that name.
        let work = tempfile::Builder::new()
            .prefix("hubtest")
            .tempdir_in(".")
            .unwrap();
        let org = work.path().file_name().unwrap().to_str().unwrap();
        let spec = format!("{org}/name");
        std::fs::create_dir_all(&spec).unwrap();
        snapshot(cache.path(), &spec, HASH, &["main"]);
        let s = settings(cache.path(), true);
        assert_eq!(resolve_model_with(&spec, &s).unwrap(), Path::new(&spec));
        // A folder whose name has an `@` is still a local folder.
        let at = work.path().join("m@v1");
        std::fs::create_dir_all(&at).unwrap();
        assert_eq!(resolve_model_with(at.to_str().unwrap(), &s).unwrap(), at);
    }

    #[test]
    fn a_missing_model_offline_names_the_id_every_place_looked_and_offline_mode() {
        let cache = tempfile::tempdir().unwrap();
        let s = settings(cache.path(), true);
        let err = format!("{:#}", resolve_model_with("org/absent@v2", &s).unwrap_err());
        let cwd = std::env::current_dir().unwrap();
        for part in [
            "`org/absent`",
            "revision `v2`",
            &cwd.join("org/absent@v2").display().to_string(),
            &cache
                .path()
                .join("models--org--absent")
                .display()
                .to_string(),
            "no refs/v2",
            "HF_HUB_OFFLINE is set",
        ] {
            assert!(err.contains(part), "`{part}` missing from: {err}");
        }
        // A ref to a snapshot that was deleted, and a snapshot without config.json.
        let repo = cache.path().join("models--org--gone");
        std::fs::create_dir_all(repo.join("refs")).unwrap();
        std::fs::write(repo.join("refs/main"), HASH).unwrap();
        let err = format!("{:#}", resolve_model_with("org/gone", &s).unwrap_err());
        assert!(
            err.contains(&format!("snapshots/{HASH} is absent")),
            "{err}"
        );
        std::fs::create_dir_all(repo.join("snapshots").join(HASH)).unwrap();
        let err = format!("{:#}", resolve_model_with("org/gone", &s).unwrap_err());
        assert!(err.contains("has no config.json"), "{err}");
        // Not a repo id and not a folder: the path and the cache, no download attempted.
        let err = format!(
            "{:#}",
            resolve_model_with("/no/such/model", &s).unwrap_err()
        );
        assert!(
            err.contains("no folder /no/such/model") && err.contains("not a Hugging Face repo id")
        );
    }

    #[test]
    fn a_failed_download_names_the_places_looked_and_the_endpoint() {
        let cache = tempfile::tempdir().unwrap();
        let s = settings(cache.path(), false);
        let err = format!("{:#}", resolve_model_with("org/absent", &s).unwrap_err());
        assert!(
            err.contains("`org/absent`") && err.contains("models--org--absent"),
            "{err}"
        );
        assert!(
            err.contains("downloading it from http://127.0.0.1:9 failed"),
            "{err}"
        );
        assert!(!err.contains("HF_HUB_OFFLINE"), "{err}");
    }

    #[test]
    fn a_snapshot_without_weights_is_used_offline_only() {
        let cache = tempfile::tempdir().unwrap();
        let snap = snapshot(cache.path(), "org/name", HASH, &["main"]);
        std::fs::remove_file(snap.join("model.safetensors")).unwrap();
        assert_eq!(
            resolve_model_with("org/name", &settings(cache.path(), true)).unwrap(),
            snap
        );
        let err = resolve_model_with("org/name", &settings(cache.path(), false)).unwrap_err();
        assert!(
            format!("{err:#}").contains("has no safetensors weights"),
            "{err:#}"
        );
    }

    #[test]
    fn only_config_weights_and_side_files_are_fetched() {
        let files = |names: &[&str]| names.iter().map(|s| s.to_string()).collect::<BTreeSet<_>>();
        let got = files_to_fetch(&files(&[
            "config.json",
            "model.safetensors",
            "consolidated.safetensors",
            "tokenizer.json",
            "README.md",
            "onnx/model.safetensors",
            "pytorch_model.bin",
            "generation_config.json",
        ]))
        .unwrap();
        assert_eq!(
            got,
            [
                "config.json",
                "tokenizer.json",
                "generation_config.json",
                "model.safetensors"
            ]
        );
        let got = files_to_fetch(&files(&["config.json", INDEX, "model.safetensors"])).unwrap();
        assert_eq!(got, ["config.json", INDEX]);
        let err = files_to_fetch(&files(&["config.json", "pytorch_model.bin"])).unwrap_err();
        assert!(
            err.to_string().contains("safetensors weights only"),
            "{err}"
        );
        assert!(files_to_fetch(&files(&["model.safetensors"])).is_err());
        let dir = tempfile::tempdir().unwrap();
        let index = dir.path().join(INDEX);
        let map = r#"{"weight_map": {"a": "m-2.safetensors", "b": "m-1.safetensors", "c": "m-2.safetensors"}}"#;
        std::fs::write(&index, map).unwrap();
        assert_eq!(
            index_shards(&index).unwrap(),
            ["m-1.safetensors", "m-2.safetensors"]
        );
        std::fs::write(&index, r#"{"weight_map": {"a": "../x.safetensors"}}"#).unwrap();
        assert!(index_shards(&index).is_err());
    }
}
