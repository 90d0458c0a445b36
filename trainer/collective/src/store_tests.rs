use super::*;
use crate::auth::WRONG_SECRET;

const WAIT: Duration = Duration::from_secs(5);

#[test]
fn clients_share_keys_through_the_hosted_store() {
    let secret = JobSecret::generate().unwrap();
    let host = TcpStore::host("127.0.0.1:0", &secret, WAIT).unwrap();
    let addr = host.server_addr().to_string();
    let t = std::thread::spawn(move || {
        let client = TcpStore::connect(&addr, &secret, WAIT).unwrap();
        let v = client.get("from-host", Duration::from_secs(10)).unwrap();
        client.set("from-client", &[v[0] + 1]).unwrap();
    });
    std::thread::sleep(Duration::from_millis(30));
    host.set("from-host", &[41]).unwrap();
    assert_eq!(
        host.get("from-client", Duration::from_secs(10)).unwrap(),
        vec![42]
    );
    t.join().unwrap();
    let err = host
        .get("never", Duration::from_millis(50))
        .unwrap_err()
        .to_string();
    assert!(err.contains("never"), "{err}");
    assert!(host.local_ip().is_loopback());
}

#[test]
fn a_client_with_the_wrong_secret_is_refused_on_both_sides_and_the_others_are_served() {
    let secret = JobSecret::generate().unwrap();
    let server = TcpStoreServer::bind("127.0.0.1:0", secret.clone()).unwrap();
    let addr = server.local_addr().to_string();
    let good = TcpStore::connect(&addr, &secret, WAIT).unwrap();
    good.set("k", b"v").unwrap();

    let wrong = JobSecret::generate().unwrap();
    let err = format!(
        "{:#}",
        TcpStore::connect(&addr, &wrong, WAIT).err().unwrap()
    );
    assert!(err.contains(&addr) && err.contains(WRONG_SECRET), "{err}");
    assert!(err.contains(JOB_SECRET_ENV), "{err}");
    let refusals = refusals_after(&server, 1);
    assert_eq!(refusals.len(), 1, "{refusals:?}");
    assert!(refusals[0].contains(WRONG_SECRET), "{refusals:?}");
    assert!(refusals[0].contains("127.0.0.1:"), "{refusals:?}");

    // The server still serves its clients, old and new.
    assert_eq!(good.get("k", WAIT).unwrap(), b"v");
    let late = TcpStore::connect(&addr, &secret, WAIT).unwrap();
    assert_eq!(late.get("k", WAIT).unwrap(), b"v");
}

/// The server's refusals once there are at least `n` (or after 2 s).
fn refusals_after(server: &TcpStoreServer, n: usize) -> Vec<String> {
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        let refusals = server.refusals();
        if refusals.len() >= n || Instant::now() >= deadline {
            return refusals;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Whether the server closed `conn` (reads end) within `within`.
fn closed_within(conn: &mut TcpStream, within: Duration) -> bool {
    conn.set_read_timeout(Some(within)).unwrap();
    let mut buf = [0u8; 256];
    loop {
        match conn.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => continue, // e.g. the server's nonce
            Err(e) => return e.kind() == std::io::ErrorKind::ConnectionReset,
        }
    }
}

#[test]
fn garbage_and_silent_clients_are_dropped_within_the_handshake_time_out() {
    let secret = JobSecret::generate().unwrap();
    let server = TcpStoreServer::bind("127.0.0.1:0", secret.clone()).unwrap();
    server.set_handshake_timeout(Duration::from_millis(300));
    let addr = server.local_addr();
    let mut silent = TcpStream::connect(addr).unwrap();
    let mut garbage = TcpStream::connect(addr).unwrap();
    garbage.write_all(&[0xee; 4096]).unwrap();

    // While both are connected, a client with the secret is served at once.
    let start = Instant::now();
    let good = TcpStore::connect(&addr.to_string(), &secret, WAIT).unwrap();
    good.set("k", b"v").unwrap();
    assert!(
        start.elapsed() < Duration::from_secs(2),
        "{:?}",
        start.elapsed()
    );

    assert!(closed_within(&mut garbage, Duration::from_secs(2)));
    let start = Instant::now();
    assert!(closed_within(&mut silent, Duration::from_secs(3)));
    assert!(
        start.elapsed() < Duration::from_secs(2),
        "{:?}",
        start.elapsed()
    );
    let refusals = refusals_after(&server, 2).join("\n");
    assert!(refusals.contains("bad magic"), "{refusals}");
    assert!(refusals.contains("timed out"), "{refusals}");
    assert_eq!(good.get("k", WAIT).unwrap(), b"v");
}

#[test]
fn a_flood_of_silent_connections_is_bounded_and_clears_after_the_time_out() {
    let secret = JobSecret::generate().unwrap();
    let server = TcpStoreServer::bind("127.0.0.1:0", secret.clone()).unwrap();
    server.set_handshake_timeout(Duration::from_millis(300));
    let addr = server.local_addr();
    let flood: Vec<TcpStream> = (0..MAX_HANDSHAKING + 8)
        .map(|_| TcpStream::connect(addr).unwrap())
        .collect();
    let refusals = refusals_after(&server, 8).join("\n");
    assert!(
        refusals.contains("other connections are handshaking"),
        "{refusals}"
    );
    assert!(server.shared.handshaking.running() <= MAX_HANDSHAKING);
    std::thread::sleep(Duration::from_millis(700));
    let good = TcpStore::connect(&addr.to_string(), &secret, WAIT).unwrap();
    good.set("k", b"v").unwrap();
    drop(flood);
}
