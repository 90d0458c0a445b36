//! Fuzzing the collectives' job-secret handshake over real TCP connections, from both sides of the rendezvous store
//! and against a rank forming its mesh: bytes in, and every input refused (nobody without the secret gets in, and a
//! process never accepts a peer that cannot prove it), promptly, with a reason. At the end the real peers still get
//! in, so garbage never wedged a listener.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use ferl_collective::{
    Communicator, GroupOptions, JobSecret, MemoryRendezvous, Rendezvous, TcpCommunicator, TcpStore,
    TcpStoreServer,
};
use ferl_fuzz::{Answer, Expect, Target};
use proptest::prelude::*;

const MAGIC: &[u8] = b"FERLAUTH";
const LIMIT: Duration = Duration::from_millis(1500);

/// Sends `input` on a fresh connection to `addr`, half-closes it, and waits (at most [`LIMIT`]) for the peer to
/// close: a listener must drop every connection that cannot prove the secret.
fn send_and_wait_for_close(addr: SocketAddr, input: &[u8]) -> Result<SocketAddr, String> {
    let mut conn = TcpStream::connect(addr).map_err(|e| format!("connecting: {e}"))?;
    let local = conn.local_addr().expect("local address");
    conn.set_read_timeout(Some(LIMIT)).expect("read time-out");
    let _ = conn.write_all(input);
    let _ = conn.shutdown(Shutdown::Write);
    let mut sink = [0u8; 256];
    loop {
        match conn.read(&mut sink) {
            Ok(0) => return Ok(local),
            Ok(_) => continue,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                panic!("the listener kept a connection that cannot prove the secret open for {LIMIT:?}")
            }
            Err(_) => return Ok(local),
        }
    }
}

/// The store's server under test, and its secret.
fn store_server() -> &'static (TcpStoreServer, JobSecret) {
    static SERVER: OnceLock<(TcpStoreServer, JobSecret)> = OnceLock::new();
    SERVER.get_or_init(|| {
        let secret = JobSecret::generate().unwrap();
        (
            TcpStoreServer::bind("127.0.0.1:0", secret.clone()).unwrap(),
            secret,
        )
    })
}

/// The store's server gets the bytes: it must close the connection and name the client in its refusals.
fn store_server_side(input: &[u8]) -> Answer {
    let (server, _) = store_server();
    let local = send_and_wait_for_close(server.local_addr(), input)?;
    let deadline = Instant::now() + LIMIT;
    loop {
        if let Some(line) = server
            .refusals()
            .into_iter()
            .find(|l| l.contains(&local.to_string()))
        {
            return Err(line);
        }
        assert!(
            Instant::now() < deadline,
            "the store closed the connection from {local} without refusing it"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// A store client meets a fake server that answers its opening with the bytes: it must fail.
fn store_client_side(input: &[u8]) -> Answer {
    let listener = TcpListener::bind("127.0.0.1:0").expect("listener");
    let addr = listener.local_addr().expect("address");
    let answer = input.to_vec();
    let fake: JoinHandle<()> = std::thread::spawn(move || {
        let Ok((mut conn, _)) = listener.accept() else {
            return;
        };
        conn.set_read_timeout(Some(LIMIT)).expect("read time-out");
        let mut opening = [0u8; 40];
        let _ = conn.read_exact(&mut opening);
        let _ = conn.write_all(&answer);
        let _ = conn.shutdown(Shutdown::Write);
        let _ = conn.read_to_end(&mut Vec::new());
    });
    let secret = JobSecret::generate().unwrap();
    let result = TcpStore::connect(&addr.to_string(), &secret, Duration::from_secs(1));
    fake.join().expect("the fake server");
    match result {
        Ok(_) => panic!("the client accepted a server that cannot know the secret"),
        Err(e) => Err(format!("{e:#}")),
    }
}

/// Rank 0 of a group of 2 forming its mesh, accepting connections until the real rank 1 joins.
struct Forming {
    store: Arc<dyn Rendezvous>,
    rank0: Option<JoinHandle<anyhow::Result<TcpCommunicator>>>,
    addr: SocketAddr,
}

fn mesh_options() -> GroupOptions {
    GroupOptions {
        prefix: "fuzz".into(),
        join_timeout: Duration::from_secs(300),
        timeout: Duration::from_secs(30),
        shared_memory: false,
        ..GroupOptions::default()
    }
}

fn forming() -> &'static std::sync::Mutex<Forming> {
    static FORMING: OnceLock<std::sync::Mutex<Forming>> = OnceLock::new();
    FORMING.get_or_init(|| {
        let store: Arc<dyn Rendezvous> = Arc::new(MemoryRendezvous::new());
        let for_rank0 = store.clone();
        let rank0 =
            std::thread::spawn(move || TcpCommunicator::connect(0, 2, for_rank0, &mesh_options()));
        let raw = store
            .get("fuzz/tcp/rank0/addr", Duration::from_secs(30))
            .unwrap();
        let addr = String::from_utf8(raw).unwrap().parse().unwrap();
        std::sync::Mutex::new(Forming {
            store,
            rank0: Some(rank0),
            addr,
        })
    })
}

/// Rank 0 forming its mesh gets the bytes: it must drop the connection.
fn mesh_side(input: &[u8]) -> Answer {
    let addr = forming().lock().unwrap().addr;
    let local = send_and_wait_for_close(addr, input)?;
    Err(format!("rank 0 dropped the connection from {local}"))
}

/// `input[0]` picks the side: the store's server, a store client, rank 0 of a mesh.
fn handshake(input: &[u8]) -> Answer {
    let Some((&side, bytes)) = input.split_first() else {
        return Err("empty input".into());
    };
    match side % 3 {
        0 => store_server_side(bytes),
        1 => store_client_side(bytes),
        _ => mesh_side(bytes),
    }
}

/// Well-formed openings and answers with wrong proofs, and mesh hellos of every rank and world.
fn handshakes() -> impl Strategy<Value = Vec<u8>> {
    let edge = prop::sample::select(vec![0u32, 1, 2, 3, u32::MAX]);
    let opening = (
        0..3u8,
        edge.clone(),
        edge,
        prop::collection::vec(any::<u8>(), 32..=72),
    )
        .prop_map(|(side, rank, world, rest)| {
            let mut out = vec![side];
            if side % 3 != 1 {
                out.extend_from_slice(MAGIC);
            }
            if side % 3 == 2 {
                out.extend_from_slice(&rank.to_le_bytes());
                out.extend_from_slice(&world.to_le_bytes());
            }
            out.extend(rest);
            out
        });
    let status = (
        prop::collection::vec(any::<u8>(), 32),
        0..3u8,
        prop::collection::vec(any::<u8>(), 32),
    )
        .prop_map(|(nonce, status, proof)| [vec![1], nonce, vec![status], proof].concat());
    prop_oneof![opening, status]
}

#[test]
fn fuzz_collective_handshakes() {
    Target::new("collective-handshake", handshake)
        .generate("handshakes", handshakes(), Expect::Refused)
        .dictionary(&[MAGIC, &[1, 0, 0, 0, 2, 0, 0, 0], &[0; 32], &[1], &[0]])
        .max_len(4 << 10)
        .run();
    // The listeners survived: a real client gets into the store, and the real rank 1 joins rank 0.
    let (server, secret) = store_server();
    let client = TcpStore::connect(
        &server.local_addr().to_string(),
        secret,
        Duration::from_secs(5),
    )
    .expect("a client with the secret gets in");
    client.set("k", b"v").unwrap();
    assert_eq!(client.get("k", Duration::from_secs(5)).unwrap(), b"v");
    let mut forming = forming().lock().unwrap();
    let rank1 = TcpCommunicator::connect(1, 2, forming.store.clone(), &mesh_options())
        .expect("rank 1 joins");
    let rank0 = forming
        .rank0
        .take()
        .unwrap()
        .join()
        .unwrap()
        .expect("rank 0 formed");
    assert_eq!((rank0.world_size(), rank1.world_size()), (2, 2));
}
