//! Guarantee 17, with a real driver process: a driver joined with `connect` spawns a named actor, a detached named
//! actor and a resource group, then is SIGKILLed. Within the heartbeat bound the head removes its group and kills
//! its actor, and forgets it as a driver; the detached actor keeps answering.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use ferl_runtime::testbed::{Counter, Get};

const BOUND: Duration = Duration::from_millis(1500);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guarantee_17_a_killed_driver_frees_its_actors_and_groups_but_not_detached_ones() {
    let head = common::head(4.0, BOUND).await;
    let address = head.cluster.head_address().unwrap().to_string();
    let mut driver = Command::new(common::testbed())
        .args(["driver", "--address", &address, "--token", &head.token])
        .env("FERL_TMPDIR", std::env::var("FERL_TMPDIR").unwrap())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("starting the driver");
    let mut line = String::new();
    BufReader::new(driver.stdout.take().unwrap())
        .read_line(&mut line)
        .expect("the driver's output");
    assert!(line.starts_with("READY "), "the driver said `{line}`");
    let status = head.cluster.status().await.unwrap();
    assert_eq!(
        status["groups"].as_array().map(Vec::len),
        Some(1),
        "{status:#}"
    );
    assert_eq!(
        status["drivers"].as_array().map(Vec::len),
        Some(1),
        "{status:#}"
    );
    let owned = head
        .cluster
        .get_actor::<Counter>("fate", "owned")
        .await
        .unwrap();
    assert_eq!(
        owned.expect("the driver's actor").call(Get).await.unwrap(),
        1
    );

    driver.kill().unwrap();
    driver.wait().unwrap();
    let killed = Instant::now();
    loop {
        let status = head.cluster.status().await.unwrap();
        let groups = status["groups"].as_array().map_or(0, Vec::len);
        let drivers = status["drivers"].as_array().map_or(0, Vec::len);
        let owned = head
            .cluster
            .get_actor::<Counter>("fate", "owned")
            .await
            .unwrap();
        if groups == 0 && drivers == 0 && owned.is_none() {
            break;
        }
        assert!(
            killed.elapsed() < BOUND * 4,
            "not freed {:?} after the kill (groups {groups}, drivers {drivers}, owned alive {})",
            killed.elapsed(),
            owned.is_some()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let freed = killed.elapsed();
    println!(
        "freed {:.2} s after the kill (bound {BOUND:?})",
        freed.as_secs_f64()
    );
    // The bound, one check period, and the stops and status calls on a loaded 2-core machine.
    assert!(
        freed < BOUND + Duration::from_secs(2),
        "freed after {freed:?}"
    );
    let kept = head
        .cluster
        .get_actor::<Counter>("fate", "kept")
        .await
        .unwrap();
    let kept = kept.expect("the detached actor outlives its driver");
    assert_eq!(kept.call(Get).await.unwrap(), 2);
}
