//! Session folders: the worker credentials stay out of the log folders `ferl status` advertises, and an embedded
//! cluster takes its session folder with it at a clean shutdown.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use ferl_runtime::testbed::*;
use ferl_runtime::{bundle, HeadOptions, NodeOptions, RuntimeConfig, SpawnOptions};

/// Every file under `dir`, recursively.
fn files_under(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap().flatten() {
        let path = entry.path();
        if path.is_dir() {
            out.extend(files_under(&path));
        } else {
            out.push(path);
        }
    }
    out
}

fn mode(path: &Path) -> u32 {
    std::fs::metadata(path).unwrap().permissions().mode() & 0o777
}

/// The one `worker-credentials-*` file of the session folder `session`, checked to be 0600 in a 0700 `secrets/`.
fn private_credentials(session: &Path) -> Vec<u8> {
    let secrets = session.join("secrets");
    assert_eq!(mode(&secrets), 0o700, "{}", secrets.display());
    let creds: Vec<PathBuf> = files_under(&secrets)
        .into_iter()
        .filter(|f| {
            f.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("worker-credentials-")
        })
        .collect();
    assert_eq!(
        creds.len(),
        1,
        "one credentials file in {}: {creds:?}",
        secrets.display()
    );
    assert_eq!(mode(&creds[0]), 0o600, "{}", creds[0].display());
    let bytes = std::fs::read(&creds[0]).unwrap();
    assert!(
        bytes.len() > 100,
        "credentials hold a CA, a certificate and a key"
    );
    bytes
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_credentials_are_private_and_outside_the_advertised_log_folders() {
    let head = common::head(2.0, Duration::from_secs(3)).await;
    let node = common::node(&head, &["--num-cpus", "1", "--resources", "special=1"], &[]);
    let cluster = &head.cluster;
    // A worker on each node: each read its node's credentials and wrote a log.
    for resources in [bundle(&[("CPU", 1.0)]), bundle(&[("special", 1.0)])] {
        let actor = cluster
            .spawn::<Counter>(0, SpawnOptions::new().resources(resources))
            .await
            .unwrap();
        assert_eq!(actor.call(Add(3)).await.unwrap(), 3);
    }
    let status = cluster.status().await.unwrap();
    let nodes = status["nodes"].as_array().unwrap();
    assert_eq!(nodes.len(), 2, "{status}");
    assert!(nodes.iter().any(|n| n["name"] == node.name.as_str()));
    for n in nodes {
        let logs = PathBuf::from(n["log_dir"].as_str().unwrap());
        let logged = files_under(&logs);
        assert!(!logged.is_empty(), "a worker log in {}", logs.display());
        let creds = private_credentials(logs.parent().unwrap());
        for f in &logged {
            let name = f.file_name().unwrap().to_string_lossy();
            assert!(
                !name.contains("credentials"),
                "{} in the log folder",
                f.display()
            );
            let text = std::fs::read(f).unwrap();
            assert!(
                !text.windows(creds.len()).any(|w| w == creds.as_slice()),
                "{} holds the worker credentials",
                f.display()
            );
        }
    }
    drop(node);
    head.cluster.shutdown().await;
}

/// Session folders under `root`.
fn sessions(root: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(root)
        .map(|d| {
            d.flatten()
                .map(|e| e.path())
                .filter(|p| {
                    p.file_name()
                        .unwrap()
                        .to_string_lossy()
                        .starts_with("session_head_")
                })
                .collect()
        })
        .unwrap_or_default()
}

/// An embedded cluster whose sessions live under `root` (`keep`: `FERL_KEEP_SESSION=1`), with a worker that logged.
async fn embedded(root: &Path, keep: bool) -> ferl_runtime::Cluster {
    let cfg = RuntimeConfig::from_lookup(|k| match k {
        "FERL_TMPDIR" => Some(root.display().to_string()),
        "FERL_KEEP_SESSION" if keep => Some("1".into()),
        _ => std::env::var(k).ok(),
    });
    let opts = HeadOptions::new()
        .node(NodeOptions::new().num_cpus(1.0).num_gpus(0))
        .worker_binary(common::testbed())
        .config(cfg);
    let cluster = ferl_runtime::init(opts).await.unwrap();
    let actor = cluster
        .spawn::<Counter>(0, SpawnOptions::new())
        .await
        .unwrap();
    assert_eq!(actor.call(Add(1)).await.unwrap(), 1);
    cluster
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_embedded_cluster_removes_its_session_folder_at_a_clean_shutdown_unless_kept() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();

    let cluster = embedded(root, false).await;
    let made = sessions(root);
    assert_eq!(made.len(), 1, "{made:?}");
    assert!(
        !files_under(&made[0].join("logs")).is_empty(),
        "the worker logged"
    );
    assert_eq!(
        std::fs::read_link(root.join("session_latest")).unwrap(),
        made[0]
    );
    cluster.shutdown().await;
    assert!(
        sessions(root).is_empty(),
        "left behind: {:?}",
        sessions(root)
    );
    assert!(
        std::fs::symlink_metadata(root.join("session_latest")).is_err(),
        "session_latest no longer points at a removed folder"
    );

    // A failed run keeps its worker logs.
    let cluster = embedded(root, false).await;
    let kept = cluster
        .keep_session()
        .expect("an embedded cluster's session");
    cluster.shutdown().await;
    assert_eq!(sessions(root), std::slice::from_ref(&kept));
    assert!(!files_under(&kept.join("logs")).is_empty());
    std::fs::remove_dir_all(&kept).unwrap();

    // So does every embedded cluster under FERL_KEEP_SESSION=1.
    let cluster = embedded(root, true).await;
    cluster.shutdown().await;
    assert_eq!(
        sessions(root).len(),
        1,
        "FERL_KEEP_SESSION=1 keeps the folder"
    );

    // A long-lived head (`ferl start --head`) keeps its session: its handle has none of its own to remove.
    let cfg = RuntimeConfig::from_lookup(|k| match k {
        "FERL_TMPDIR" => Some(root.display().to_string()),
        _ => std::env::var(k).ok(),
    });
    let opts = HeadOptions::new()
        .node(NodeOptions::new().num_cpus(1.0).num_gpus(0))
        .config(cfg);
    let head = ferl_runtime::start_head(opts).await.unwrap();
    assert!(head.cluster.keep_session().is_none());
    head.cluster.shutdown().await;
    assert_eq!(sessions(root).len(), 2, "start_head's session stays");
}
