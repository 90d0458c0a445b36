//! Same-host call lanes (guarantee 13): calls between processes of one host leave QUIC for a Unix socket.

mod common;

fn lanes_opened() -> u64 {
    ferl_runtime::stats().lanes_opened
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guarantee_13_calls_to_a_process_on_the_same_host_take_a_lane() {
    let cluster = common::cluster().await;
    let before = lanes_opened();
    common::exercise_call_paths(&cluster).await;
    assert!(
        lanes_opened() > before,
        "the driver's calls to its worker never left QUIC"
    );
}
