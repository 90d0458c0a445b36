//! Files shipped with a spawn (`SpawnOptions::ship_file`): a node agent without the file fetches it from the driver
//! by sha256 (in chunks), caches it, and tells the worker where it is; a later spawn finds it in the cache; a file
//! that does not exist is refused at the spawn, naming it.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use ferl_runtime::testbed::*;
use ferl_runtime::{bundle, SpawnOptions};
use sha2::Digest;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shipped_file_reaches_a_remote_worker_once_and_is_verified() {
    let head = common::head(1.0, Duration::from_secs(3)).await;
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("node-cache");
    let _n = common::node(
        &head,
        &["--num-cpus", "2", "--resources", "remote=2"],
        &[("FERL_BIN_CACHE", cache.to_str().unwrap())],
    );
    // Over one chunk (4 MiB), so the node assembles it from several calls.
    let bytes: Vec<u8> = (0..(5u32 << 20)).map(|i| (i % 251) as u8).collect();
    let src = dir.path().join("weights.bin");
    std::fs::write(&src, &bytes).unwrap();
    let sha = hex::encode(sha2::Sha256::digest(&bytes));
    let opts = || {
        SpawnOptions::new()
            .resources(bundle(&[("remote", 1.0)]))
            .ship_file("weights", &src)
    };

    let before = ferl_runtime::stats().file_chunks_served;
    let a = head.cluster.spawn::<Counter>(1, opts()).await.unwrap();
    assert_eq!(
        ferl_runtime::stats().file_chunks_served - before,
        2,
        "5 MiB in 4 MiB chunks"
    );
    let listing = a
        .call(GetEnv(ferl_runtime::SHIPPED_FILES_ENV.into()))
        .await
        .unwrap()
        .expect("the worker was told where its files are");
    let files: BTreeMap<String, String> = serde_json::from_str(&listing).unwrap();
    let local = std::path::PathBuf::from(&files["weights"]);
    assert_eq!(local, cache.join("files").join(format!("{sha}.bin")));
    assert_eq!(std::fs::read(&local).unwrap(), bytes);
    let stamp = std::fs::metadata(&local).unwrap().modified().unwrap();

    // A second actor on that node: found in the cache, nothing is sent.
    let before = ferl_runtime::stats().file_chunks_served;
    let b = head.cluster.spawn::<Counter>(2, opts()).await.unwrap();
    assert_eq!(b.call(Get).await.unwrap(), 2);
    assert_eq!(ferl_runtime::stats().file_chunks_served, before);
    assert_eq!(
        std::fs::metadata(&local).unwrap().modified().unwrap(),
        stamp
    );

    // A file that is not there fails the spawn, naming the file and its shipped name.
    let missing = dir.path().join("missing.bin");
    let Err(e) = head
        .cluster
        .spawn::<Counter>(3, SpawnOptions::new().ship_file("gone", &missing))
        .await
    else {
        panic!("a spawn shipping a missing file was accepted")
    };
    let e = e.to_string();
    assert!(e.contains("`gone`") && e.contains("missing.bin"), "{e}");
}
