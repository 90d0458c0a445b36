//! `model.partial_pretrain=ORG/NAME` against a Hub served on 127.0.0.1 (`HF_ENDPOINT`): the resolver lists the repo
//! through the info API, downloads only what a model needs into an empty Hugging Face cache (the layout
//! `huggingface_hub` writes), and afterwards finds the same snapshot offline without contacting the server.
//!
//! One test function: it sets the process's Hugging Face variables, so nothing may run beside it in this binary.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::sync::{Arc, Mutex};

use ferl_trainer::model::hub::resolve_model;
use ferl_trainer::model::{init_model, load_model};
use safetensors::SafeTensors;

const REPO: &str = "tiny-org/tiny-qwen2";
const SHA: &str = "4f2b8c6d0e1a3b5c7d9e0f1a2b3c4d5e6f7a8b9c";

/// A minimal Hub: one model repo at commit [`SHA`] (branch `main`, tag `v1`), and the log of request paths.
struct Hub {
    files: BTreeMap<String, Vec<u8>>,
    log: Mutex<Vec<String>>,
}

impl Hub {
    /// Starts the server on 127.0.0.1 and returns its base URL.
    fn serve(self: &Arc<Self>) -> String {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let hub = self.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let hub = hub.clone();
                std::thread::spawn(move || hub.handle(stream));
            }
        });
        format!("http://{addr}")
    }

    fn requests(&self) -> Vec<String> {
        self.log.lock().unwrap().clone()
    }

    /// One request per connection (`Connection: close`).
    fn handle(&self, stream: TcpStream) {
        let mut reader = BufReader::new(stream.try_clone().unwrap());
        let mut line = String::new();
        if reader.read_line(&mut line).unwrap_or(0) == 0 {
            return;
        }
        let mut parts = line.split_whitespace();
        let (method, path) = (
            parts.next().unwrap_or(""),
            parts.next().unwrap_or("").to_string(),
        );
        let mut range = None;
        loop {
            let mut h = String::new();
            if reader.read_line(&mut h).unwrap_or(0) == 0 || h.trim().is_empty() {
                break;
            }
            if let Some((k, v)) = h.split_once(':') {
                if k.trim().eq_ignore_ascii_case("range") {
                    range = Some(v.trim().to_string());
                }
            }
        }
        self.log.lock().unwrap().push(path.clone());
        let (status, headers, body) = if method == "GET" {
            self.route(&path, range.as_deref())
        } else {
            (405, vec![], b"method".to_vec())
        };
        let mut out = stream;
        let reason = match status {
            200 => "OK",
            206 => "Partial Content",
            404 => "Not Found",
            _ => "Error",
        };
        let mut head = format!(
            "HTTP/1.1 {status} {reason}\r\nContent-Length: {}\r\nConnection: close\r\n",
            body.len()
        );
        for (k, v) in headers {
            head.push_str(&format!("{k}: {v}\r\n"));
        }
        head.push_str("\r\n");
        out.write_all(head.as_bytes()).ok();
        out.write_all(&body).ok();
        out.flush().ok();
    }

    fn route(&self, path: &str, range: Option<&str>) -> (u16, Vec<(String, String)>, Vec<u8>) {
        let not_found = |what: &str| {
            let h = vec![("X-Error-Code".into(), "RepoNotFound".into())];
            (
                404,
                h,
                format!("{{\"error\": \"{what} not found\"}}").into_bytes(),
            )
        };
        let known_rev = |r: &str| matches!(r, "main" | "v1" | SHA);
        if let Some(rest) = path.strip_prefix(&format!("/api/models/{REPO}/revision/")) {
            if !known_rev(rest) {
                return not_found("revision");
            }
            let siblings: Vec<serde_json::Value> = self
                .files
                .keys()
                .map(|f| serde_json::json!({ "rfilename": f }))
                .collect();
            let body = serde_json::json!({ "id": REPO, "sha": SHA, "siblings": siblings });
            let h = vec![("Content-Type".into(), "application/json".into())];
            return (200, h, body.to_string().into_bytes());
        }
        let Some(rest) = path.strip_prefix(&format!("/{REPO}/resolve/")) else {
            return not_found("repository");
        };
        let Some((rev, file)) = rest.split_once('/') else {
            return not_found("entry");
        };
        let Some(data) = self.files.get(file).filter(|_| known_rev(rev)) else {
            return not_found("entry");
        };
        let size = data.len();
        let (start, end) = match range.and_then(|r| r.strip_prefix("bytes=")) {
            Some(r) => {
                let (a, b) = r.split_once('-').unwrap();
                let a: usize = a.parse().unwrap();
                let b = if b.is_empty() {
                    size - 1
                } else {
                    b.parse::<usize>().unwrap().min(size - 1)
                };
                (a, b)
            }
            None => (0, size - 1),
        };
        let etag = format!("\"{:08x}{size:x}\"", crc32fast::hash(data));
        let mut h: Vec<(String, String)> = vec![
            ("X-Repo-Commit".into(), SHA.into()),
            ("ETag".into(), etag),
            ("Accept-Ranges".into(), "bytes".into()),
        ];
        let status = if range.is_some() {
            h.push((
                "Content-Range".into(),
                format!("bytes {start}-{end}/{size}"),
            ));
            206
        } else {
            200
        };
        (status, h, data[start..=end].to_vec())
    }
}

/// A tiny Qwen2 repo: the asset config with a small vocabulary, random weights split into two shards with an
/// index, the Qwen3 tokenizer files, plus files a model load never needs (which must not be fetched).
fn tiny_repo(tmp: &Path) -> BTreeMap<String, Vec<u8>> {
    let assets = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../assets");
    let mut config: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(assets.join("models/tiny-qwen2/config.json")).unwrap(),
    )
    .unwrap();
    config["vocab_size"] = 512.into();
    let cfg_dir = tmp.join("cfg");
    std::fs::create_dir_all(&cfg_dir).unwrap();
    std::fs::write(cfg_dir.join("config.json"), config.to_string()).unwrap();
    let src = tmp.join("src");
    init_model(
        &cfg_dir.join("config.json"),
        Some(&assets.join("tokenizers/qwen3")),
        &src,
        3,
    )
    .unwrap();

    let mut files = BTreeMap::new();
    for entry in std::fs::read_dir(&src).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_str().unwrap().to_string();
        if name != "model.safetensors" {
            files.insert(name, std::fs::read(&path).unwrap());
        }
    }
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors = st.tensors();
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    let half = tensors.len() / 2;
    let mut weight_map = serde_json::Map::new();
    for (i, part) in [&tensors[..half], &tensors[half..]].into_iter().enumerate() {
        let shard = format!("model-0000{}-of-00002.safetensors", i + 1);
        for (name, _) in part {
            weight_map.insert(name.clone(), shard.clone().into());
        }
        let views: Vec<(String, &safetensors::tensor::TensorView)> =
            part.iter().map(|(n, v)| (n.clone(), v)).collect();
        files.insert(shard, safetensors::serialize(views, None).unwrap());
    }
    let index =
        serde_json::json!({ "metadata": { "total_size": bytes.len() }, "weight_map": weight_map });
    files.insert(
        "model.safetensors.index.json".into(),
        index.to_string().into_bytes(),
    );
    for unused in [
        "consolidated.safetensors",
        "onnx/model.safetensors",
        "pytorch_model.bin",
        "README.md",
    ] {
        files.insert(unused.into(), b"never fetched".to_vec());
    }
    assert!(files.contains_key("tokenizer.json") && files.contains_key("generation_config.json"));
    files
}

fn set_hf_env(endpoint: &str, cache: &Path, hf_home: &Path) {
    for var in [
        "HF_TOKEN",
        "HUGGING_FACE_HUB_TOKEN",
        "HF_TOKEN_PATH",
        "HF_HUB_OFFLINE",
        "TRANSFORMERS_OFFLINE",
        "HUGGINGFACE_HUB_CACHE",
        "ALL_PROXY",
        "all_proxy",
        "HTTPS_PROXY",
        "https_proxy",
        "HTTP_PROXY",
        "http_proxy",
    ] {
        std::env::remove_var(var);
    }
    std::env::set_var("HF_ENDPOINT", endpoint);
    std::env::set_var("HF_HUB_CACHE", cache);
    std::env::set_var("HF_HOME", hf_home);
}

/// After the first download: `refs/main` names the commit (and no ref is named after the commit), the snapshot
/// holds exactly the files a model needs as links into `blobs/`, with the served bytes, and the Hub saw one listing
/// of `main` and then only file requests at the pinned commit (none for the unused files).
fn assert_download_layout(hub: &Hub, repo_dir: &Path, snapshot: &Path) {
    assert_eq!(
        std::fs::read_to_string(repo_dir.join("refs/main")).unwrap(),
        SHA
    );
    assert!(
        !repo_dir.join("refs").join(SHA).exists(),
        "no ref named after a commit"
    );
    let needed = [
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "model.safetensors.index.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ];
    for name in needed {
        let local = snapshot.join(name);
        assert_eq!(
            std::fs::read(&local).unwrap(),
            hub.files[name],
            "{name} differs from the served file"
        );
        let link =
            std::fs::read_link(&local).unwrap_or_else(|e| panic!("{name} is not a blob link: {e}"));
        assert!(
            link.starts_with("../../blobs"),
            "{name} -> {}",
            link.display()
        );
    }
    let requests = hub.requests();
    for unused in [
        "consolidated.safetensors",
        "onnx/",
        "pytorch_model.bin",
        "README.md",
    ] {
        assert!(
            !requests.iter().any(|r| r.contains(unused)),
            "{unused} was requested: {requests:?}"
        );
        assert!(!snapshot.join(unused).exists(), "{unused} was downloaded");
    }
    assert_eq!(requests[0], format!("/api/models/{REPO}/revision/main"));
    assert!(
        requests
            .iter()
            .skip(1)
            .all(|r| r.starts_with(&format!("/{REPO}/resolve/{SHA}/"))),
        "{requests:?}"
    );
}

#[test]
fn a_hub_id_downloads_into_an_empty_cache_then_resolves_offline_to_the_same_snapshot() {
    let tmp = tempfile::tempdir().unwrap();
    let hub = Arc::new(Hub {
        files: tiny_repo(tmp.path()),
        log: Mutex::new(Vec::new()),
    });
    let endpoint = hub.serve();
    let cache = tmp.path().join("cache");
    set_hf_env(&endpoint, &cache, &tmp.path().join("hf_home"));
    // Run from the temp folder so `tiny-org/tiny-qwen2` is not a local path by accident.
    std::env::set_current_dir(tmp.path()).unwrap();

    // Online, empty cache: downloaded.
    let dir = resolve_model(REPO).unwrap();
    let repo_dir = cache.join("models--tiny-org--tiny-qwen2");
    let snapshot = repo_dir.join("snapshots").join(SHA);
    assert_eq!(dir, snapshot);
    assert_download_layout(&hub, &repo_dir, &snapshot);

    // The downloaded folder is a working model and tokenizer.
    let loaded = load_model(&dir).unwrap();
    assert_eq!(loaded.config.vocab_size, 512);
    assert_eq!(loaded.params.len(), loaded.layout.tensors.len());
    ferl_trainer::data::tokenizer::SftTokenizer::from_dir(&dir, None).unwrap();

    // Cached: the same snapshot for the branch and the commit, online or offline, without contacting the server.
    let before = hub.requests().len();
    let same = |spec: &str| assert_eq!(resolve_model(spec).unwrap(), snapshot, "{spec}");
    same(REPO);
    std::env::set_var("HF_HUB_OFFLINE", "1");
    same(REPO);
    same(&format!("{REPO}@main"));
    same(&format!("{REPO}@{SHA}"));
    assert_eq!(
        hub.requests().len(),
        before,
        "a cached model contacted the Hub"
    );

    // Offline, a revision never fetched: one error naming the id, the places looked at and offline mode.
    let err = format!("{:#}", resolve_model(&format!("{REPO}@v1")).unwrap_err());
    for part in [REPO, "revision `v1`", "no refs/v1", "HF_HUB_OFFLINE is set"] {
        assert!(err.contains(part), "`{part}` missing from: {err}");
    }
    assert!(
        err.contains(&repo_dir.display().to_string())
            && err.contains(&tmp.path().join(REPO).display().to_string())
    );
    assert_eq!(
        hub.requests().len(),
        before,
        "offline mode contacted the Hub"
    );

    // Online, a new tag of the same commit: listed once, nothing downloaded again, `refs/v1` recorded.
    std::env::remove_var("HF_HUB_OFFLINE");
    assert_eq!(resolve_model(&format!("{REPO}@v1")).unwrap(), snapshot);
    assert_eq!(
        hub.requests()[before..],
        [format!("/api/models/{REPO}/revision/v1")]
    );
    assert_eq!(
        std::fs::read_to_string(repo_dir.join("refs/v1")).unwrap(),
        SHA
    );

    // Online, a repo the Hub does not have: the id, the local path, the cache folder and the endpoint.
    let err = format!("{:#}", resolve_model("tiny-org/absent").unwrap_err());
    for part in [
        "`tiny-org/absent`".to_string(),
        tmp.path().join("tiny-org/absent").display().to_string(),
        cache.join("models--tiny-org--absent").display().to_string(),
        format!("downloading it from {endpoint} failed"),
        "404".to_string(),
    ] {
        assert!(err.contains(&part), "`{part}` missing from: {err}");
    }
}
