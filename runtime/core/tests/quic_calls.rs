//! With same-host lanes off (`FERL_LANES=0`, what a peer on another host sees), every call path stays on QUIC.
//! Its own test binary: the variable is read by every process of the cluster.

mod common;

fn lanes_opened() -> u64 {
    ferl_runtime::stats().lanes_opened
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guarantee_13_with_lanes_off_calls_streams_and_order_hold_on_quic() {
    common::set_env("FERL_LANES", "0");
    let cluster = common::cluster().await;
    common::exercise_call_paths(&cluster).await;
    assert_eq!(lanes_opened(), 0, "a lane opened although FERL_LANES=0");
}
