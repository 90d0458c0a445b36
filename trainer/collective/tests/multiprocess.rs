//! Collectives across real processes on one host: results against a reference computed locally (over shared memory,
//! and with some ranks on TCP), a rank killed or stopped mid-collective on either transport, and joining through the
//! launcher environment (torchrun and SLURM variables).

mod common;

use common::*;
use ferl_collective::{
    init_from_env, Communicator, GroupOptions, JobSecret, LaunchEnv, ReduceOp, TcpCommunicator,
    TcpStoreServer, Transport,
};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tch::{Device, Kind, Tensor};

/// Ranks (comma-separated) the parent test told to refuse shared memory (`FERL_COLLECTIVE_SHM=0`).
const TCP_RANKS_VAR: &str = "FERL_COLLECTIVE_TEST_TCP_RANKS";

/// Joins the group of the launcher environment as [`init_from_env`] does, keeping the concrete type so the test can
/// ask which transport each pair uses.
fn tcp_from_env() -> TcpCommunicator {
    let launch = LaunchEnv::from_env().unwrap();
    let mut options = GroupOptions::default();
    let hosted = std::env::var("FERL_STORE_HOSTED").is_ok_and(|v| v == "1");
    let store = launch.rendezvous(hosted, &options).unwrap();
    options.bind_ip = Some(store.local_ip());
    TcpCommunicator::connect(launch.rank, launch.world_size, Arc::new(store), &options).unwrap()
}

/// Asserts this rank reaches every peer over shared memory, except the pairs with a rank the parent put on TCP.
fn check_transports(comm: &TcpCommunicator) {
    let tcp_ranks: Vec<usize> = std::env::var(TCP_RANKS_VAR)
        .unwrap_or_default()
        .split(',')
        .filter_map(|r| r.parse().ok())
        .collect();
    let r = comm.rank();
    for p in (0..comm.world_size()).filter(|p| *p != r) {
        let expected = if tcp_ranks.contains(&r) || tcp_ranks.contains(&p) {
            Transport::Tcp
        } else {
            Transport::SharedMemory
        };
        assert_eq!(comm.transport(p), Some(expected), "rank {r} to rank {p}");
    }
}

/// The environment that puts `rank` on TCP when it is one of `tcp_ranks`.
fn transport_env(rank: usize, tcp_ranks: &[usize]) -> Vec<(String, String)> {
    let list: Vec<String> = tcp_ranks.iter().map(|r| r.to_string()).collect();
    let mut env = vec![(TCP_RANKS_VAR.to_string(), list.join(","))];
    if tcp_ranks.contains(&rank) {
        env.push(("FERL_COLLECTIVE_SHM".into(), "0".into()));
    }
    env
}

/// Rank `rank`'s deterministic input: small integers, so sums are exact even in bf16.
fn input(rank: usize, n: usize, kind: Kind, salt: i64) -> Tensor {
    let idx = Tensor::arange(n as i64, (Kind::Int64, Device::Cpu));
    ((idx * 7 + (rank as i64 + 1) * 31 + salt).remainder(97) - 48).to_kind(kind)
}

fn sum_of(world: usize, n: usize, kind: Kind, salt: i64) -> Tensor {
    let parts: Vec<Tensor> = (0..world).map(|q| input(q, n, kind, salt)).collect();
    Tensor::stack(&parts, 0).sum_dim_intlist(0, false, kind)
}

fn assert_same(what: &str, got: &Tensor, expected: &Tensor) {
    assert_eq!(got.size(), expected.size(), "{what}: shape");
    assert!(
        got.equal(expected),
        "{what}: result differs from the reference"
    );
}

/// Every collective on every size and type, checked against the reference; runs on each rank.
fn check_all_collectives(comm: &dyn Communicator) {
    let (r, w) = (comm.rank(), comm.world_size());
    let cases: &[(Kind, &[usize])] = &[
        (Kind::Float, &[0, 1, 7, 1001, 40_003, (1 << 21) + 3]),
        (Kind::BFloat16, &[0, 5, 33_333]),
        (Kind::Int64, &[0, 3, 20_001]),
    ];
    for &(kind, sizes) in cases {
        for &n in sizes {
            let tag = format!("{kind:?} n={n} w={w} r={r}");
            let mut t = input(r, n, kind, 1);
            comm.all_reduce(&mut t, ReduceOp::Sum).unwrap();
            assert_same(&format!("all_reduce sum {tag}"), &t, &sum_of(w, n, kind, 1));

            let mut t = input(r, n, kind, 2);
            comm.all_reduce(&mut t, ReduceOp::Max).unwrap();
            let parts: Vec<Tensor> = (0..w).map(|q| input(q, n, kind, 2)).collect();
            let max = Tensor::stack(&parts, 0).amax([0i64].as_slice(), false);
            assert_same(&format!("all_reduce max {tag}"), &t, &max);

            let inp = input(r, n, kind, 3);
            let gathered = comm.all_gather_flat(&inp).unwrap();
            let parts: Vec<Tensor> = (0..w).map(|q| input(q, n, kind, 3)).collect();
            assert_same(
                &format!("all_gather {tag}"),
                &gathered,
                &Tensor::cat(&parts, 0),
            );

            let inp = input(r, n * w, kind, 4);
            let shard = comm.reduce_scatter_flat(&inp, ReduceOp::Sum).unwrap();
            let full = sum_of(w, n * w, kind, 4);
            assert_same(
                &format!("reduce_scatter {tag}"),
                &shard,
                &full.narrow(0, (r * n) as i64, n as i64),
            );

            for root in [0, w - 1] {
                let mut t = if r == root {
                    input(r, n, kind, 5)
                } else {
                    Tensor::zeros([n as i64], (kind, Device::Cpu))
                };
                comm.broadcast(&mut t, root).unwrap();
                assert_same(
                    &format!("broadcast root {root} {tag}"),
                    &t,
                    &input(root, n, kind, 5),
                );
            }

            let inp = input(r, n * w, kind, 6);
            let mut out = Tensor::zeros([(n * w) as i64], (kind, Device::Cpu));
            comm.all_to_all(&mut out, &inp).unwrap();
            let parts: Vec<Tensor> = (0..w)
                .map(|q| input(q, n * w, kind, 6).narrow(0, (r * n) as i64, n as i64))
                .collect();
            assert_same(&format!("all_to_all {tag}"), &out, &Tensor::cat(&parts, 0));
        }
    }
    let mut t = input(r, 1003, Kind::Float, 7);
    comm.all_reduce(&mut t, ReduceOp::Avg).unwrap();
    let avg = sum_of(w, 1003, Kind::Float, 7) / w as f64;
    assert!(t.allclose(&avg, 1e-6, 1e-6, false), "all_reduce avg");
    comm.barrier().unwrap();
}

/// Runs every collective in a group of `world` processes whose ranks `tcp_ranks` refuse shared memory.
fn run_reference_check(test: &str, world: usize, tcp_ranks: &[usize]) {
    if is_rank() {
        let comm = tcp_from_env();
        assert_eq!((comm.rank(), comm.world_size()), (my_rank(), world));
        check_transports(&comm);
        check_all_collectives(&comm);
        println!("OK rank {}", comm.rank());
        return;
    }
    let secret = JobSecret::from_hex(&job_secret_hex()).unwrap();
    let store = TcpStoreServer::bind("127.0.0.1:0", secret).unwrap();
    let port = store.local_addr().port();
    let mut ranks = spawn_ranks(test, world, |r| {
        let mut env = torchrun_env(r, world, port);
        env.push(("FERL_STORE_HOSTED".into(), "1".into()));
        env.extend(transport_env(r, tcp_ranks));
        env
    });
    for (r, p) in ranks.iter_mut().enumerate() {
        assert!(
            p.wait_exit(Duration::from_secs(600)).success(),
            "rank {r} failed"
        );
        p.wait_line("OK rank", Duration::from_secs(5));
    }
}

#[test]
fn collectives_match_reference_world_2() {
    run_reference_check("collectives_match_reference_world_2", 2, &[]);
}

#[test]
fn collectives_match_reference_world_3() {
    run_reference_check("collectives_match_reference_world_3", 3, &[]);
}

#[test]
fn collectives_match_reference_world_4() {
    run_reference_check("collectives_match_reference_world_4", 4, &[]);
}

#[test]
fn collectives_match_reference_world_2_over_tcp() {
    run_reference_check("collectives_match_reference_world_2_over_tcp", 2, &[0, 1]);
}

#[test]
fn collectives_match_reference_world_3_mixed_transports() {
    // Pairs with rank 1 use TCP, the pair (0, 2) shared memory: a ring that crosses both.
    run_reference_check(
        "collectives_match_reference_world_3_mixed_transports",
        3,
        &[1],
    );
}

/// Exit code of a rank whose collective failed (as the failure tests expect).
const FAILED: i32 = 17;

/// Rank side of the failure tests: all-reduce a 16 MiB tensor until a collective fails, then report how.
fn all_reduce_until_failure() {
    collective_until_failure(false)
}

/// [`all_reduce_until_failure`], or with `all_to_all` the exchange Ulysses sequence parallelism runs around
/// attention.
fn collective_until_failure(all_to_all: bool) {
    let comm = tcp_from_env();
    check_transports(&comm);
    let mut t = Tensor::ones([4 << 20], (Kind::Float, Device::Cpu));
    let mut out = t.zeros_like();
    let mut rounds = 0u64;
    loop {
        let done = match all_to_all {
            true => comm.all_to_all(&mut out, &t),
            false => comm.all_reduce(&mut t, ReduceOp::Max),
        };
        if let Err(e) = done {
            println!("FAILED after {rounds} rounds: {e:#}");
            std::process::exit(FAILED);
        }
        rounds += 1;
        if rounds == 1 {
            println!("READY");
        }
    }
}

/// Starts a group running [`all_reduce_until_failure`], every rank on TCP when `tcp` (else on shared memory).
fn spawn_failure_group(test: &str, world: usize, timeout_s: u64, tcp: bool) -> Vec<RankProcess> {
    let port = ferl_collective::free_local_port();
    let tcp_ranks: Vec<usize> = if tcp { (0..world).collect() } else { vec![] };
    spawn_ranks(test, world, |r| {
        let mut env = torchrun_env(r, world, port);
        env.push(("FERL_COLLECTIVE_TIMEOUT_S".into(), timeout_s.to_string()));
        // Joining may take long on a loaded machine (a rank hosts the store and starts late); only collectives
        // should be bound by the short timeout.
        env.push(("FERL_COLLECTIVE_JOIN_TIMEOUT_S".into(), "120".into()));
        env.extend(transport_env(r, &tcp_ranks));
        env
    })
}

/// Kills rank 2 of 4 mid-all-reduce (or mid-all-to-all); every other rank must fail with an error long before the
/// 120 s timeout.
fn check_killed_rank(test: &str, tcp: bool) {
    check_killed_rank_in(test, tcp, false)
}

fn check_killed_rank_in(test: &str, tcp: bool, all_to_all: bool) {
    if is_rank() {
        return collective_until_failure(all_to_all);
    }
    let mut ranks = spawn_failure_group(test, 4, 120, tcp);
    for p in &ranks {
        p.wait_line("READY", Duration::from_secs(120));
    }
    std::thread::sleep(Duration::from_millis(300));
    ranks[2].child.kill().unwrap(); // SIGKILL
    let killed_at = Instant::now();
    for (r, p) in ranks.iter_mut().enumerate().filter(|(r, _)| *r != 2) {
        let status = p.wait_exit(Duration::from_secs(60));
        assert_eq!(
            status.code(),
            Some(FAILED),
            "rank {r} should report the failure"
        );
        let line = p.wait_line("FAILED", Duration::from_secs(5));
        assert!(line.contains("rank"), "{line}");
    }
    let took = killed_at.elapsed();
    assert!(
        took < Duration::from_secs(60),
        "ranks took {took:?} to fail after a peer died"
    );
}

#[test]
fn killed_rank_makes_every_other_rank_fail_promptly() {
    check_killed_rank("killed_rank_makes_every_other_rank_fail_promptly", false);
}

#[test]
fn killed_rank_during_all_to_all_makes_every_other_rank_fail_promptly() {
    check_killed_rank_in(
        "killed_rank_during_all_to_all_makes_every_other_rank_fail_promptly",
        false,
        true,
    );
}

#[test]
fn killed_rank_makes_every_other_rank_fail_promptly_over_tcp() {
    check_killed_rank(
        "killed_rank_makes_every_other_rank_fail_promptly_over_tcp",
        true,
    );
}

/// Stops rank 1 of 2 with SIGSTOP; rank 0 must fail once the 2 s timeout has passed, naming the timeout and rank 1.
fn check_stalled_rank(test: &str, tcp: bool) {
    if is_rank() {
        return all_reduce_until_failure();
    }
    let mut ranks = spawn_failure_group(test, 2, 2, tcp);
    for p in &ranks {
        p.wait_line("READY", Duration::from_secs(120));
    }
    let stalled = nix::unistd::Pid::from_raw(ranks[1].child.id() as i32);
    nix::sys::signal::kill(stalled, nix::sys::signal::Signal::SIGSTOP).unwrap();
    let stopped_at = Instant::now();
    let status = ranks[0].wait_exit(Duration::from_secs(90));
    let took = stopped_at.elapsed();
    assert_eq!(status.code(), Some(FAILED));
    let line = ranks[0].wait_line("FAILED", Duration::from_secs(5));
    assert!(
        line.contains("timeout") && line.contains("rank 1"),
        "{line}"
    );
    assert!(
        took >= Duration::from_millis(1500),
        "failed after {took:?}, before the 2 s timeout could pass"
    );
    ranks[1].child.kill().unwrap();
}

#[test]
fn stalled_rank_makes_the_other_fail_after_the_timeout() {
    check_stalled_rank("stalled_rank_makes_the_other_fail_after_the_timeout", false);
}

#[test]
fn stalled_rank_makes_the_other_fail_after_the_timeout_over_tcp() {
    check_stalled_rank(
        "stalled_rank_makes_the_other_fail_after_the_timeout_over_tcp",
        true,
    );
}

/// Rank side of the launch tests: a small all-reduce and a barrier.
fn join_and_sum() {
    let comm = init_from_env(Device::Cpu).unwrap();
    let mut t = Tensor::from_slice(&[comm.rank() as f32 + 1.0, 10.0]);
    comm.all_reduce(&mut t, ReduceOp::Sum).unwrap();
    let w = comm.world_size() as f32;
    assert_eq!(
        Vec::<f32>::try_from(&t).unwrap(),
        vec![w * (w + 1.0) / 2.0, 10.0 * w]
    );
    comm.barrier().unwrap();
    println!("OK rank {} of {}", comm.rank(), comm.world_size());
}

#[test]
fn torchrun_environment_with_rank0_hosting_the_store() {
    if is_rank() {
        return join_and_sum();
    }
    let port = ferl_collective::free_local_port();
    let mut ranks = spawn_ranks(
        "torchrun_environment_with_rank0_hosting_the_store",
        3,
        |r| torchrun_env(r, 3, port),
    );
    for (r, p) in ranks.iter_mut().enumerate() {
        assert!(p.wait_exit(Duration::from_secs(120)).success(), "rank {r}");
        assert_eq!(
            p.wait_line("OK", Duration::from_secs(5)),
            format!("OK rank {r} of 3")
        );
    }
}

#[test]
fn slurm_environment_forms_the_group() {
    if is_rank() {
        return join_and_sum();
    }
    let port = ferl_collective::free_local_port();
    let mut ranks = spawn_ranks("slurm_environment_forms_the_group", 2, |r| {
        vec![
            ("FERL_JOB_SECRET".into(), job_secret_hex()),
            ("SLURM_PROCID".into(), r.to_string()),
            ("SLURM_NTASKS".into(), "2".into()),
            ("SLURM_LOCALID".into(), r.to_string()),
            ("MASTER_ADDR".into(), "127.0.0.1".into()),
            ("MASTER_PORT".into(), port.to_string()),
        ]
    });
    for (r, p) in ranks.iter_mut().enumerate() {
        assert!(p.wait_exit(Duration::from_secs(120)).success(), "rank {r}");
        assert_eq!(
            p.wait_line("OK", Duration::from_secs(5)),
            format!("OK rank {r} of 2")
        );
    }
}

#[test]
fn launcher_ranks_without_the_job_secret_are_refused_naming_it() {
    if is_rank() {
        std::env::remove_var("FERL_JOB_SECRET");
        let err = init_from_env(Device::Cpu)
            .err()
            .expect("joined without a secret");
        println!("REFUSED {err:#}");
        return;
    }
    let port = ferl_collective::free_local_port();
    let mut ranks = spawn_ranks(
        "launcher_ranks_without_the_job_secret_are_refused_naming_it",
        2,
        |r| torchrun_env(r, 2, port),
    );
    for p in ranks.iter_mut() {
        assert!(p.wait_exit(Duration::from_secs(60)).success());
        let line = p.wait_line("REFUSED", Duration::from_secs(5));
        assert!(line.contains("FERL_JOB_SECRET is not set"), "{line}");
    }
}
