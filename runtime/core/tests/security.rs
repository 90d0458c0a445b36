//! Security and the wire: wrong tokens are refused; garbage, oversized and wrong-version frames close only the
//! offending connection; nodes lacking the driver's binary fetch it by sha256.

mod common;

use std::time::Duration;

use ferl_runtime::testbed::*;
use ferl_runtime::{bundle, SpawnOptions};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guarantee_7_wrong_token_is_refused_with_a_clear_error() {
    let head = common::head(2.0, Duration::from_secs(3)).await;
    let addr = head.cluster.head_address().unwrap().to_string();
    let err = ferl_runtime::connect(&addr, Some("not-the-token".into()))
        .await
        .err()
        .expect("refused");
    assert!(
        format!("{err:#}").contains("wrong cluster token"),
        "{err:#}"
    );
    match &err {
        ferl_runtime::Error::JoinRefused { head, reason } => {
            assert_eq!(head, &addr);
            assert!(reason.contains("wrong cluster token"), "{reason}");
        }
        other => panic!("a refused join gives JoinRefused, not {other:?}"),
    }
    let ok = ferl_runtime::connect(&addr, Some(head.token.clone()))
        .await
        .expect("the right token joins");
    ok.kv_put("joined", vec![1]).await.unwrap();
    assert_eq!(head.cluster.kv_get("joined").await.unwrap(), Some(vec![1]));
    // A node agent with a wrong token exits with the reason.
    let out = std::process::Command::new(common::testbed())
        .args(["node", "--address", &addr, "--token", "bad"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("wrong cluster token"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

async fn closed_reason_after(conn: &quinn::Connection, bytes: &[u8]) -> String {
    let (mut send, _recv) = conn.open_bi().await.unwrap();
    send.write_all(bytes).await.unwrap();
    let reason = tokio::time::timeout(Duration::from_secs(10), conn.closed())
        .await
        .expect("connection closed");
    reason.to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guarantee_8_garbage_oversized_and_wrong_version_frames_close_only_that_connection() {
    let head = common::head(2.0, Duration::from_secs(3)).await;
    let v = ferl_wire::WIRE_VERSION.to_le_bytes();

    let mut oversized = (1u32 << 31).to_le_bytes().to_vec();
    oversized.extend_from_slice(&v);
    let reason = closed_reason_after(&common::member_connection(&head).await, &oversized).await;
    assert!(reason.contains("exceeds the maximum"), "{reason}");

    let mut wrong = 10u32.to_le_bytes().to_vec();
    wrong.extend_from_slice(&77u16.to_le_bytes());
    wrong.extend_from_slice(&[0; 8]);
    let reason = closed_reason_after(&common::member_connection(&head).await, &wrong).await;
    assert!(reason.contains("wire version 77"), "{reason}");

    let mut garbage = 66u32.to_le_bytes().to_vec();
    garbage.extend_from_slice(&v);
    garbage.extend_from_slice(&[0xAB; 64]);
    let reason = closed_reason_after(&common::member_connection(&head).await, &garbage).await;
    assert!(reason.contains("malformed"), "{reason}");

    // Without a certificate, anything but the join handshake is refused.
    let endpoint = quinn::Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
    let join_cfg = ferl_runtime::testing::join_client_config(Duration::from_secs(5)).unwrap();
    let conn = endpoint
        .connect_with(
            join_cfg,
            head.cluster.head_address().unwrap(),
            "ferl.cluster",
        )
        .unwrap()
        .await
        .unwrap();
    let reason = closed_reason_after(&conn, &garbage).await;
    assert!(reason.contains("join"), "{reason}");

    // The head is unharmed.
    head.cluster.kv_put("still", vec![2]).await.unwrap();
    let a = head
        .cluster
        .spawn::<Counter>(3, SpawnOptions::new())
        .await
        .unwrap();
    assert_eq!(a.call(Get).await.unwrap(), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guarantee_11_node_without_the_binary_fetches_it_by_sha256_once() {
    let head = common::head(1.0, Duration::from_secs(3)).await;
    let cache = tempfile::tempdir().unwrap();
    let cache_path = cache.path().to_str().unwrap().to_string();
    let _n = common::node(
        &head,
        &["--num-cpus", "2", "--resources", "remote=2"],
        &[
            ("FERL_NODE_FORCE_FETCH", "1"),
            ("FERL_BIN_CACHE", &cache_path),
        ],
    );
    let remote = || SpawnOptions::new().resources(bundle(&[("remote", 1.0)]));
    let a = head.cluster.spawn::<Counter>(4, remote()).await.unwrap();
    assert_eq!(a.call(Get).await.unwrap(), 4);
    let files: Vec<_> = std::fs::read_dir(cache.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert_eq!(files.len(), 1, "{files:?}");
    assert_eq!(files[0].len(), 64, "cached under its sha256: {files:?}");
    let bytes = std::fs::read(common::testbed()).unwrap();
    use sha2::Digest;
    assert_eq!(files[0], hex::encode(sha2::Sha256::digest(&bytes)));
    let b = head.cluster.spawn::<Counter>(5, remote()).await.unwrap();
    assert_eq!(b.call(Get).await.unwrap(), 5);
}
