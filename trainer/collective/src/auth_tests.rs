use super::*;
use std::net::TcpListener;
use std::thread;

/// Two ends of one loopback connection: (connecting side, accepted side).
fn pair() -> (TcpStream, TcpStream) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
    (client, listener.accept().unwrap().0)
}

fn handshake<'a>(secret: &'a JobSecret, context: &'a [u8], timeout: Duration) -> Handshake<'a> {
    Handshake {
        secret,
        context,
        timeout,
    }
}

/// Runs both sides with the given secrets and contexts; returns (initiator's result, responder's result).
fn run_both(
    mine: (&JobSecret, &'static [u8]),
    theirs: (&JobSecret, &'static [u8]),
) -> (Result<Vec<u8>>, Result<Vec<u8>>) {
    let (mut client, mut server) = pair();
    let theirs = (theirs.0.clone(), theirs.1);
    let responder = thread::spawn(move || {
        handshake(&theirs.0, theirs.1, Duration::from_secs(5)).respond(&mut server, 3, |hello| {
            assert_eq!(hello, b"abc");
            Ok(b"xy".to_vec())
        })
    });
    let initiated =
        handshake(mine.0, mine.1, Duration::from_secs(5)).initiate(&mut client, b"abc", 2);
    (initiated, responder.join().unwrap())
}

#[test]
fn invariant_2_3_same_secret_and_context_pass_both_ways() {
    let secret = JobSecret::generate().unwrap();
    let (i, r) = run_both((&secret, b"ctx"), (&secret, b"ctx"));
    assert_eq!(i.unwrap(), b"xy");
    assert_eq!(r.unwrap(), b"abc");
}

#[test]
fn invariant_3_a_wrong_secret_is_refused_and_named_on_both_sides() {
    let (a, b) = (
        JobSecret::generate().unwrap(),
        JobSecret::generate().unwrap(),
    );
    let (i, r) = run_both((&a, b"ctx"), (&b, b"ctx"));
    let (i, r) = (
        format!("{:#}", i.unwrap_err()),
        format!("{:#}", r.unwrap_err()),
    );
    assert!(i.contains("refused") && i.contains(WRONG_SECRET), "{i}");
    assert!(r.contains(WRONG_SECRET), "{r}");
}

#[test]
fn invariant_2_a_proof_for_another_context_is_refused() {
    let secret = JobSecret::generate().unwrap();
    let (i, r) = run_both((&secret, b"group-a"), (&secret, b"group-b"));
    assert!(i.is_err() && r.is_err());
}

#[test]
fn invariant_4_garbage_is_refused_without_reading_past_the_fixed_sized_hello() {
    let (mut client, mut server) = pair();
    let sender = thread::spawn(move || {
        let _ = client.write_all(&vec![0x5a; 1 << 20]);
    });
    let secret = JobSecret::generate().unwrap();
    let err = handshake(&secret, b"ctx", Duration::from_secs(5))
        .respond(&mut server, 8, |_| panic!("garbage passed the magic check"))
        .unwrap_err();
    assert!(err.to_string().contains("bad magic"), "{err}");
    drop(server);
    sender.join().unwrap();
}

#[test]
fn invariant_4_a_silent_or_trickling_peer_is_dropped_at_the_time_out() {
    let secret = JobSecret::generate().unwrap();
    for trickle in [false, true] {
        let (mut client, mut server) = pair();
        let sender = thread::spawn(move || {
            // One byte of a valid hello every 50 ms: 48 bytes would take 2.4 s.
            for byte in MAGIC.iter().chain([0u8; 40].iter()).filter(|_| trickle) {
                if client.write_all(&[*byte]).is_err() {
                    break;
                }
                thread::sleep(Duration::from_millis(50));
            }
            thread::sleep(Duration::from_millis(600));
        });
        let start = Instant::now();
        let err = handshake(&secret, b"ctx", Duration::from_millis(300))
            .respond(&mut server, 8, |_| Ok(Vec::new()))
            .unwrap_err();
        let took = start.elapsed();
        assert!(err.to_string().contains("timed out"), "{err}");
        assert!(
            took < Duration::from_millis(1000),
            "took {took:?} (trickle {trickle})"
        );
        drop(server);
        sender.join().unwrap();
    }
}

#[test]
fn secrets_parse_from_hex_and_never_print() {
    let secret = JobSecret::generate().unwrap();
    assert_eq!(secret.to_hex().len(), 64);
    assert_eq!(
        JobSecret::from_hex(&format!(" {}\n", secret.to_hex())).unwrap(),
        secret
    );
    assert_eq!(format!("{secret:?}"), "JobSecret(<redacted>)");
    let short = JobSecret::from_hex("abcd").unwrap_err().to_string();
    assert!(short.contains("2 bytes"), "{short}");
    let bad = JobSecret::from_hex("not hex").unwrap_err().to_string();
    assert!(bad.contains("not hex"), "{bad}");
    assert_ne!(JobSecret::generate().unwrap(), secret);
}
