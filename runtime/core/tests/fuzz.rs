//! Fuzzing the wire (guarantee 8): the call-stream frame decoder, the runtime's messages, and both sides of the join
//! handshake (guarantee 7) get bytes from `ferl-fuzz` (seed corpus in `fuzz/corpus/runtime-*`, mutations, proptest
//! inputs): no panic, no hang, every refusal an error, and no joiner ever admitted without the token.

use ferl_fuzz::{Answer, Expect, Target};
use ferl_runtime::testing::{head_exchange, joiner_exchange};
use ferl_runtime::testing::{join_proof, Credentials};
use ferl_runtime::{ActorAddress, Wire};
use ferl_wire::protocol::{
    Body, CallKind, CreateGroup, DriverAdmitted, Event, Frame, JoinMsg, KvPut, NodeAdmitted,
    RegisterDriver, RegisterNode, RemoteError, RemoteErrorKind, SpawnSpec, Strategy as Placing,
};
use ferl_wire::{encode_frame, read_frame, FrameError, WIRE_VERSION};
use proptest::collection::vec;
use proptest::prelude::*;
use rkyv::util::AlignedVec;

/// The frame limit of these tests (the transport's is 64 MiB; the code path is the same).
const MAX_FRAME: usize = 1 << 20;
const TOKEN: &str = "fuzz-token";
const HEAD_CERT: &[u8] = b"the head's certificate";

/// Reads a call stream the way the transport does: frames (length, version, bytecheck), then the inline payload a
/// frame announces. A frame that validates in place must also deserialise.
fn decode_stream(bytes: &[u8]) -> Answer {
    futures::executor::block_on(async {
        let mut reader = bytes;
        let mut buf = AlignedVec::new();
        loop {
            if !read_frame(&mut reader, MAX_FRAME, &mut buf)
                .await
                .map_err(|e| e.to_string())?
            {
                return Ok(());
            }
            Frame::access(&buf).map_err(|e| e.to_string())?;
            let frame = Frame::from_wire(&buf).unwrap_or_else(|e| {
                panic!("a frame that validates in place does not deserialise: {e}")
            });
            if let Frame::Call { body, .. } | Frame::Reply { body, .. } | Frame::Item { body, .. } =
                frame
            {
                read_inline(&mut reader, body).await?;
            }
        }
    })
}

async fn read_inline(reader: &mut &[u8], body: Body) -> Answer {
    use tokio::io::AsyncReadExt;
    let Body::Inline(len) = body else {
        return Ok(());
    };
    let err = |e: FrameError| e.to_string();
    if len > MAX_FRAME as u64 {
        return Err(err(FrameError::TooLarge {
            len: len as usize,
            max: MAX_FRAME,
        }));
    }
    let mut payload = vec![0u8; len as usize];
    reader
        .read_exact(&mut payload)
        .await
        .map(drop)
        .map_err(|e| err(e.into()))
}

fn body() -> impl Strategy<Value = (Body, Vec<u8>)> {
    prop_oneof![
        vec(any::<u8>(), 0..64).prop_map(|p| (Body::Inline(p.len() as u64), p)),
        any::<u64>().prop_map(|id| (Body::Bulk(id), vec![])),
        (any::<u64>(), any::<u64>())
            .prop_map(|(offset, len)| (Body::Shared { offset, len }, vec![])),
    ]
}

fn frame() -> impl Strategy<Value = (Frame, Vec<u8>)> {
    let call = (any::<u64>(), any::<u64>(), ".{0,24}", 0..3u8, body()).prop_map(
        |(req, actor, msg, kind, (body, payload))| {
            let kind = [CallKind::Tell, CallKind::Call, CallKind::Stream][kind as usize];
            let frame = Frame::Call {
                req,
                actor,
                msg,
                kind,
                body,
            };
            (frame, payload)
        },
    );
    let reply = (any::<u64>(), body(), any::<bool>()).prop_map(|(req, (body, payload), item)| {
        let frame = if item {
            Frame::Item { req, body }
        } else {
            Frame::Reply { req, body }
        };
        (frame, payload)
    });
    let end = (any::<u64>(), proptest::option::of(".{0,16}")).prop_map(|(req, message)| {
        let error = message.map(|message| RemoteError {
            kind: RemoteErrorKind::Handler,
            message,
        });
        (Frame::End { req, error }, vec![])
    });
    let other = (any::<u32>(), any::<u64>(), vec(any::<u8>(), 0..40), 0..5u8).prop_map(
        |(pid, n, nonce, which)| {
            let frame = match which {
                0 => Frame::ShmOffer {
                    pid,
                    fd: pid as i32,
                    capacity: n,
                    nonce,
                },
                1 => Frame::ShmAnswer {
                    accepted: n % 2 == 0,
                    reason: format!("{n}"),
                },
                2 => Frame::Pause {
                    actor: n,
                    epoch: pid as u64,
                },
                3 => Frame::LaneAsk,
                _ => Frame::LaneOffer {
                    pid,
                    name: format!("lane-{n}"),
                    nonce,
                },
            };
            (frame, vec![])
        },
    );
    prop_oneof![call, reply, end, other]
}

fn encode(frames: &[(Frame, Vec<u8>)]) -> Vec<u8> {
    let mut out = Vec::new();
    for (frame, payload) in frames {
        encode_frame(frame, &mut out).expect("encodes");
        out.extend_from_slice(payload);
    }
    out
}

#[test]
fn fuzz_call_stream_frames() {
    let streams = vec(frame(), 1..4).prop_map(|frames| encode(&frames));
    // One frame cut anywhere inside: the stream ends mid-frame, which must be an error.
    let truncated = (frame(), any::<prop::sample::Index>()).prop_map(|(frame, at)| {
        let bytes = encode(&[frame]);
        bytes[..1 + at.index(bytes.len() - 1)].to_vec()
    });
    let v = WIRE_VERSION.to_le_bytes();
    Target::new("runtime-frames", decode_stream)
        .generate("call streams", streams, Expect::Any)
        .generate("truncated frames", truncated, Expect::Refused)
        .dictionary(&[
            &v,
            &[0xff, 0xff, 0xff, 0x7f],
            &[0, 0, 0, 1],
            &[0x10, 0, 0, 0],
        ])
        .run();
}

/// Decodes `bytes[1..]` as the message type chosen by `bytes[0]`, from a borrowed and from an owned buffer;
/// what decodes must encode and decode again.
fn decode_message(bytes: &[u8]) -> Answer {
    let Some((&tag, body)) = bytes.split_first() else {
        return Err("empty input".into());
    };
    match tag % 11 {
        0 => round_trip::<Frame>(body),
        1 => round_trip::<JoinMsg>(body),
        2 => round_trip::<Event>(body),
        3 => round_trip::<SpawnSpec>(body),
        4 => round_trip::<RegisterNode>(body),
        5 => round_trip::<Credentials>(body),
        6 => round_trip::<KvPut>(body),
        7 => round_trip::<NodeAdmitted>(body),
        8 => round_trip::<RegisterDriver>(body),
        9 => round_trip::<DriverAdmitted>(body),
        _ => round_trip::<CreateGroup>(body),
    }
}

fn round_trip<T: Wire>(body: &[u8]) -> Answer {
    let mut owned = AlignedVec::<16>::with_capacity(body.len());
    owned.extend_from_slice(body);
    let shared = T::from_wire_owned(owned);
    let copied = T::from_wire(body);
    assert_eq!(
        shared.is_ok(),
        copied.is_ok(),
        "owned and borrowed decoding disagree"
    );
    let value = copied.map_err(|e| e.to_string())?;
    let again = value.to_wire().expect("a decoded message encodes");
    T::from_wire(&again).unwrap_or_else(|e| panic!("a re-encoded message does not decode: {e}"));
    Ok(())
}

fn tagged<T: Wire + std::fmt::Debug>(tag: u8, value: T) -> Vec<u8> {
    let mut out = vec![tag];
    out.extend_from_slice(&value.to_wire().expect("encodes"));
    out
}

fn join_msg() -> impl Strategy<Value = JoinMsg> {
    (vec(any::<u8>(), 0..40), vec(any::<u8>(), 0..40), 0..5u8).prop_map(|(a, b, which)| match which
    {
        0 => JoinMsg::Hello { nonce: a },
        1 => JoinMsg::Challenge { nonce: a, proof: b },
        2 => JoinMsg::Proof { proof: a },
        3 => JoinMsg::Accepted {
            ca_der: a,
            cert_der: b.clone(),
            key_der: b,
        },
        _ => JoinMsg::Refused {
            reason: format!("{a:?}"),
        },
    })
}

fn message() -> impl Strategy<Value = Vec<u8>> {
    let spec =
        (".{0,16}", vec(any::<u8>(), 0..32), any::<u32>()).prop_map(|(type_name, args, n)| {
            let spec = SpawnSpec {
                type_name,
                args,
                bundle: Some((n as u64, n)),
                resources: [("CPU".to_string(), n as f64)].into(),
                env: vec![("K".into(), "V".into())],
                max_restarts: n,
                ..Default::default()
            };
            tagged(3, spec)
        });
    let event = (".{0,16}", any::<u64>()).prop_map(|(node, id)| {
        let actor = ActorAddress {
            id,
            type_name: node.clone(),
            addr: "127.0.0.1:1".into(),
            node,
        };
        tagged(2, Event::ActorRestarted { actor })
    });
    let kv = (".{0,16}", vec(any::<u8>(), 0..64))
        .prop_map(|(key, value)| tagged(6, KvPut { key, value }));
    let admitted = (".{0,16}", any::<u64>()).prop_map(|(name, heartbeat_interval_ms)| {
        tagged(
            7,
            NodeAdmitted {
                name,
                heartbeat_interval_ms,
            },
        )
    });
    let driver =
        (any::<u32>(), ".{0,16}", ".{0,32}", any::<u64>()).prop_map(|(pid, host, command, id)| {
            match id % 2 {
                0 => tagged(8, RegisterDriver { pid, host, command }),
                _ => tagged(
                    9,
                    DriverAdmitted {
                        id,
                        heartbeat_interval_ms: u64::from(pid),
                    },
                ),
            }
        });
    let group = (any::<u32>(), any::<u64>(), 0..5u8).prop_map(|(n, owner, which)| {
        let strategy = match which {
            0 => Placing::Pack,
            1 => Placing::Spread,
            2 => Placing::StrictPack,
            3 => Placing::StrictSpread,
            _ => Placing::NodeBlocks(n),
        };
        let bundles = vec![[("CPU".to_string(), f64::from(n))].into(); (n % 4) as usize];
        tagged(
            10,
            CreateGroup {
                bundles,
                strategy,
                timeout_ms: owner,
                owner,
            },
        )
    });
    prop_oneof![
        frame().prop_map(|(f, _)| tagged(0, f)),
        join_msg().prop_map(|m| tagged(1, m)),
        spec,
        event,
        kv,
        admitted,
        driver,
        group
    ]
}

#[test]
fn fuzz_runtime_messages() {
    Target::new("runtime-messages", decode_message)
        .generate("messages", message(), Expect::Any)
        .seconds(10)
        .run();
}

/// The head's side of the join handshake, fed the joiner's bytes: it may never admit them (the proof over the
/// head's fresh nonce cannot be in the input).
fn head_side(bytes: &[u8]) -> Answer {
    let mut rx = bytes;
    let mut tx = tokio::io::sink();
    match futures::executor::block_on(head_exchange(&mut rx, &mut tx, TOKEN, HEAD_CERT)) {
        Ok(()) => panic!("the head admitted a joiner without a valid proof"),
        Err(e) => Err(format!("{e:#}")),
    }
}

/// The joiner's side, fed the head's bytes: it may never accept credentials from a head without the token.
fn joiner_side(bytes: &[u8]) -> Answer {
    let mut rx = bytes;
    let mut tx = tokio::io::sink();
    let exchange = joiner_exchange(&mut rx, &mut tx, TOKEN, HEAD_CERT, "fuzz-head");
    match futures::executor::block_on(exchange) {
        Ok(_) => panic!("the joiner accepted a head without a valid proof"),
        Err(e) => Err(format!("{e:#}")),
    }
}

fn frames_of(msgs: Vec<JoinMsg>) -> Vec<u8> {
    let mut out = Vec::new();
    for m in &msgs {
        encode_frame(m, &mut out).expect("encodes");
    }
    out
}

/// A well-formed exchange from the other side, with proofs made with the right token over a guessed nonce.
fn exchange(first: fn(Vec<u8>, Vec<u8>) -> JoinMsg) -> impl Strategy<Value = Vec<u8>> {
    (vec(any::<u8>(), 32), vec(any::<u8>(), 32), join_msg()).prop_map(
        move |(nonce, guess, last)| {
            let proof = join_proof(TOKEN, "member", &guess, HEAD_CERT);
            frames_of(vec![
                first(nonce, proof.clone()),
                JoinMsg::Proof { proof },
                last,
            ])
        },
    )
}

#[test]
fn fuzz_join_handshake_head_side() {
    let hello = |nonce, _| JoinMsg::Hello { nonce };
    Target::new("runtime-join-head", head_side)
        .generate("joiner exchanges", exchange(hello), Expect::Refused)
        .generate(
            "message sequences",
            vec(join_msg(), 0..4).prop_map(frames_of),
            Expect::Refused,
        )
        .seconds(10)
        .run();
}

#[test]
fn fuzz_join_handshake_joiner_side() {
    let challenge = |nonce, proof| JoinMsg::Challenge { nonce, proof };
    Target::new("runtime-join-joiner", joiner_side)
        .generate("head exchanges", exchange(challenge), Expect::Refused)
        .generate(
            "message sequences",
            vec(join_msg(), 0..4).prop_map(frames_of),
            Expect::Refused,
        )
        .seconds(10)
        .run();
}
