//! The mesh's job-secret handshake between ranks that are threads of this process: a rank or an impostor with the
//! wrong secret is refused and named on both sides while the right ranks join; a silent connection delays no one; a
//! group without any secret is refused, a group of one needs none.

use ferl_collective::{
    Communicator, GroupOptions, JobSecret, MemoryRendezvous, ReduceOp, Rendezvous, TcpCommunicator,
};
use std::net::TcpStream;
use std::sync::Arc;
use std::thread::{sleep, spawn, JoinHandle};
use std::time::{Duration, Instant};
use tch::Tensor;

fn options(secret: &JobSecret, join_timeout: Duration) -> GroupOptions {
    GroupOptions {
        prefix: "auth-test".into(),
        job_secret: Some(secret.clone()),
        join_timeout,
        timeout: Duration::from_secs(60),
        ..GroupOptions::default()
    }
}

fn join(
    rank: usize,
    world: usize,
    store: &Arc<dyn Rendezvous>,
    options: GroupOptions,
) -> JoinHandle<anyhow::Result<TcpCommunicator>> {
    let store = store.clone();
    spawn(move || TcpCommunicator::connect(rank, world, store, &options))
}

/// Rank 0's published address, once it is there.
fn rank0_addr(store: &Arc<dyn Rendezvous>) -> String {
    let raw = store
        .get("auth-test/tcp/rank0/addr", Duration::from_secs(10))
        .unwrap();
    String::from_utf8(raw).unwrap()
}

fn sums_to_three(comms: [TcpCommunicator; 2]) {
    let handles = comms.map(|c| {
        spawn(move || {
            let mut t = Tensor::from_slice(&[c.rank() as f32 + 1.0]);
            c.all_reduce(&mut t, ReduceOp::Sum).unwrap();
            Vec::<f32>::try_from(&t).unwrap()
        })
    });
    for h in handles {
        assert_eq!(h.join().unwrap(), vec![3.0]);
    }
}

#[test]
fn an_impostor_with_the_wrong_secret_is_refused_and_the_real_rank_joins() {
    let store: Arc<dyn Rendezvous> = Arc::new(MemoryRendezvous::new());
    let secret = JobSecret::generate().unwrap();
    let rank0 = join(0, 2, &store, options(&secret, Duration::from_secs(30)));
    let addr = rank0_addr(&store);
    let wrong = JobSecret::generate().unwrap();
    let impostor = join(1, 2, &store, options(&wrong, Duration::from_secs(30)));
    let err = format!("{:#}", impostor.join().unwrap().err().unwrap());
    assert!(
        err.contains(&format!("rank 1: joining rank 0 at {addr}"))
            && err.contains("wrong job secret"),
        "{err}"
    );
    let rank1 = join(1, 2, &store, options(&secret, Duration::from_secs(30)));
    sums_to_three([
        rank0.join().unwrap().unwrap(),
        rank1.join().unwrap().unwrap(),
    ]);
}

#[test]
fn a_rank_with_the_wrong_secret_fails_and_the_listener_names_it_at_its_deadline() {
    let store: Arc<dyn Rendezvous> = Arc::new(MemoryRendezvous::new());
    let (right, wrong) = (
        JobSecret::generate().unwrap(),
        JobSecret::generate().unwrap(),
    );
    let rank0 = join(0, 2, &store, options(&right, Duration::from_secs(3)));
    let rank1 = join(1, 2, &store, options(&wrong, Duration::from_secs(30)));
    let joiner = format!("{:#}", rank1.join().unwrap().err().unwrap());
    assert!(joiner.contains("wrong job secret"), "{joiner}");
    let listener = format!("{:#}", rank0.join().unwrap().err().unwrap());
    assert!(
        listener.contains("ranks [1] did not connect")
            && listener.contains("claiming rank 1: wrong job secret"),
        "{listener}"
    );
}

#[test]
fn silent_and_garbage_connections_do_not_delay_the_real_ranks() {
    let store: Arc<dyn Rendezvous> = Arc::new(MemoryRendezvous::new());
    let secret = JobSecret::generate().unwrap();
    let rank0 = join(0, 2, &store, options(&secret, Duration::from_secs(30)));
    let addr = rank0_addr(&store);
    let silent = TcpStream::connect(&addr).unwrap();
    let mut garbage = TcpStream::connect(&addr).unwrap();
    std::io::Write::write_all(&mut garbage, &[0xab; 4096]).unwrap();
    sleep(Duration::from_millis(100));
    let start = Instant::now();
    let rank1 = join(1, 2, &store, options(&secret, Duration::from_secs(30)));
    let comms = [
        rank0.join().unwrap().unwrap(),
        rank1.join().unwrap().unwrap(),
    ];
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "joining took {:?} beside a silent connection",
        start.elapsed()
    );
    sums_to_three(comms);
    drop(silent);
}

/// A store that vouches for no one: no [`Rendezvous::job_secret`].
struct NoSecret(MemoryRendezvous);

impl Rendezvous for NoSecret {
    fn set(&self, key: &str, value: &[u8]) -> anyhow::Result<()> {
        self.0.set(key, value)
    }

    fn get(&self, key: &str, timeout: Duration) -> anyhow::Result<Vec<u8>> {
        self.0.get(key, timeout)
    }
}

#[test]
fn a_group_without_a_secret_is_refused_but_a_group_of_one_needs_none() {
    let store: Arc<dyn Rendezvous> = Arc::new(NoSecret(MemoryRendezvous::new()));
    let options = GroupOptions::default();
    assert!(options.job_secret.is_none());
    let err = TcpCommunicator::connect(0, 2, store.clone(), &options)
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("no job secret"), "{err}");
    let alone = TcpCommunicator::connect(0, 1, store, &options).unwrap();
    let mut t = Tensor::from_slice(&[5.0f32]);
    alone.all_reduce(&mut t, ReduceOp::Sum).unwrap();
    assert_eq!(Vec::<f32>::try_from(&t).unwrap(), vec![5.0]);
}
