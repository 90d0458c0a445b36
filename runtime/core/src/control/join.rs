//! The join handshake, both sides. A process without cluster credentials connects to the head with an unverified
//! TLS session, and both prove knowledge of the token (bound to the head's certificate); the head then mints a
//! certificate for the joiner. A wrong token is refused with a clear error on both sides (guarantee 7).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{anyhow, bail, Context as _, Result};
use rkyv::util::AlignedVec;
use rustls::pki_types::CertificateDer;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};

use crate::codec::{encode_frame, read_message};
use crate::protocol::JoinMsg;
use crate::security::tls::{constant_time_eq, join_proof, ClusterCa, Credentials};
use crate::transport;
use crate::transport::error::Error;

const JOIN_MAX_FRAME: usize = 64 << 10;
const JOIN_TIMEOUT: Duration = Duration::from_secs(20);

/// Length of the nonces both sides send.
const NONCE_LEN: usize = 32;

async fn send<W: AsyncWrite + Unpin>(stream: &mut W, msg: &JoinMsg) -> Result<()> {
    let mut bytes = Vec::new();
    encode_frame(msg, &mut bytes)?;
    stream.write_all(&bytes).await?;
    Ok(())
}

async fn recv<R: AsyncRead + Unpin>(stream: &mut R) -> Result<JoinMsg> {
    let mut buf = AlignedVec::new();
    read_message::<JoinMsg, _>(stream, JOIN_MAX_FRAME, &mut buf)
        .await?
        .ok_or_else(|| anyhow!("peer closed the join stream"))
}

fn check_nonce(nonce: &[u8], whose: &str) -> Result<()> {
    if nonce.len() != NONCE_LEN {
        bail!(
            "{whose} join nonce has {} bytes, expected {NONCE_LEN}",
            nonce.len()
        );
    }
    Ok(())
}

/// The head's side of the join exchange over any byte streams (a QUIC stream in production): reads the joiner's
/// `Hello`, answers with a `Challenge`, and checks the joiner's `Proof`. `Ok` means the joiner knows `token`; the
/// caller then sends the credentials. A joiner that breaks the protocol or whose proof is wrong gets an error (and a
/// `Refused` message for a wrong token).
#[cfg_attr(
    not(feature = "testing"),
    expect(unreachable_pub, reason = "public through the `testing` feature")
)]
pub async fn head_exchange<R, W>(
    rx: &mut R,
    tx: &mut W,
    token: &str,
    head_cert: &[u8],
) -> Result<()>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let JoinMsg::Hello { nonce } = recv(rx).await? else {
        bail!("expected Hello")
    };
    check_nonce(&nonce, "the joiner's")?;
    let ours: [u8; NONCE_LEN] = rand::random();
    let proof = join_proof(token, "head", &nonce, head_cert);
    let challenge = JoinMsg::Challenge {
        nonce: ours.to_vec(),
        proof,
    };
    send(tx, &challenge).await?;
    let JoinMsg::Proof { proof } = recv(rx).await? else {
        bail!("expected Proof (the joiner gave up: its token differs)")
    };
    if !constant_time_eq(&proof, &join_proof(token, "member", &ours, head_cert)) {
        let refusal = JoinMsg::Refused {
            reason: "wrong cluster token".into(),
        };
        send(tx, &refusal).await?;
        bail!("wrong cluster token");
    }
    Ok(())
}

/// The joiner's side of the join exchange over any byte streams: sends `Hello`, checks the head's proof, sends its
/// own, and returns the credentials the head answers with. `head` names the head in errors; a refusal (the head's,
/// or a head whose proof does not match the token) is an [`Error::JoinRefused`] inside the `anyhow` error.
#[cfg_attr(
    not(feature = "testing"),
    expect(unreachable_pub, reason = "public through the `testing` feature")
)]
pub async fn joiner_exchange<R, W>(
    rx: &mut R,
    tx: &mut W,
    token: &str,
    head_cert: &[u8],
    head: &str,
) -> Result<Credentials>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let nonce: [u8; NONCE_LEN] = rand::random();
    send(
        tx,
        &JoinMsg::Hello {
            nonce: nonce.to_vec(),
        },
    )
    .await?;
    let JoinMsg::Challenge {
        nonce: theirs,
        proof,
    } = recv(rx)
        .await
        .with_context(|| format!("join handshake with {head}"))?
    else {
        bail!("the process at {head} did not answer the join handshake");
    };
    if !constant_time_eq(&proof, &join_proof(token, "head", &nonce, head_cert)) {
        return Err(Error::JoinRefused {
            head: head.into(),
            reason: "wrong cluster token (the head's proof does not match the token given; pass the token printed \
                     by `ferl start --head` with --token or FERL_TOKEN)"
                .into(),
        }
        .into());
    }
    check_nonce(&theirs, "the head's")?;
    let proof = join_proof(token, "member", &theirs, head_cert);
    send(tx, &JoinMsg::Proof { proof }).await?;
    match recv(rx).await? {
        JoinMsg::Accepted {
            ca_der,
            cert_der,
            key_der,
        } => Ok(Credentials {
            ca_der,
            cert_der,
            key_der,
        }),
        JoinMsg::Refused { reason } => Err(Error::JoinRefused {
            head: head.into(),
            reason,
        }
        .into()),
        _ => bail!("unexpected join answer from {head}"),
    }
}

/// The head's side: token and CA.
pub(crate) struct JoinService {
    pub token: String,
    pub ca: ClusterCa,
    pub head_cert: Vec<u8>,
}

impl JoinService {
    /// Runs the handshake on one connection; logs refusals.
    pub(crate) async fn serve(self: Arc<Self>, conn: quinn::Connection) {
        let peer = conn.remote_address();
        match tokio::time::timeout(JOIN_TIMEOUT, self.handshake(&conn)).await {
            Ok(Ok(())) => tracing::info!(%peer, "member joined"),
            Ok(Err(e)) => {
                tracing::warn!(%peer, "refused join: {e:#}");
                conn.close(3u32.into(), format!("join refused: {e}").as_bytes());
            }
            Err(_) => conn.close(3u32.into(), b"join timed out"),
        }
    }

    async fn handshake(&self, conn: &quinn::Connection) -> Result<()> {
        let (mut tx, mut rx) = conn.accept_bi().await?;
        if let Err(e) = head_exchange(&mut rx, &mut tx, &self.token, &self.head_cert).await {
            // Let a refusal reach the joiner before the connection closes.
            let _ = tx.finish();
            tokio::time::sleep(Duration::from_millis(200)).await;
            return Err(e);
        }
        let creds = self
            .ca
            .issue(&format!("member-{}", conn.remote_address()))?;
        send(
            &mut tx,
            &JoinMsg::Accepted {
                ca_der: creds.ca_der,
                cert_der: creds.cert_der,
                key_der: creds.key_der,
            },
        )
        .await?;
        tx.finish()?;
        // Wait for the joiner to close so the last message is delivered.
        let _ = tokio::time::timeout(JOIN_TIMEOUT, conn.closed()).await;
        Ok(())
    }
}

/// The joiner's side: returns credentials minted by the head at `head`. A head that refuses (a wrong token) gives
/// [`Error::JoinRefused`] with its reason; one that cannot be reached, or does not finish the handshake in time,
/// [`Error::Unreachable`].
#[cfg_attr(
    not(feature = "testing"),
    expect(unreachable_pub, reason = "public through the `testing` feature")
)]
pub async fn join(
    head: SocketAddr,
    token: &str,
    idle: Duration,
) -> std::result::Result<Credentials, Error> {
    let bind: SocketAddr = if head.is_ipv4() {
        SocketAddr::from(([0, 0, 0, 0], 0))
    } else {
        SocketAddr::from(([0u16; 8], 0))
    };
    let endpoint = quinn::Endpoint::client(bind)
        .map_err(|e| Error::Startup(format!("opening a QUIC endpoint on {bind}: {e}")))?;
    let result = tokio::time::timeout(JOIN_TIMEOUT, join_on(&endpoint, head, token, idle))
        .await
        .unwrap_or_else(|_| {
            Err(Error::Unreachable {
                addr: head.to_string(),
                reason: format!("joining the cluster at {head} timed out after {JOIN_TIMEOUT:?}"),
            })
        });
    endpoint.close(0u32.into(), b"joined");
    result
}

async fn join_on(
    endpoint: &quinn::Endpoint,
    head: SocketAddr,
    token: &str,
    idle: Duration,
) -> std::result::Result<Credentials, Error> {
    let unreachable = |reason: String| Error::Unreachable {
        addr: head.to_string(),
        reason,
    };
    let client = transport::join_client(idle).map_err(|e| Error::Startup(format!("{e:#}")))?;
    let conn = endpoint
        .connect_with(client, head, crate::security::tls::CLUSTER_SERVER_NAME)
        .map_err(|e| unreachable(e.to_string()))?
        .await
        .map_err(|e| unreachable(format!("connecting to the head at {head}: {e}")))?;
    let head_cert = conn
        .peer_identity()
        .and_then(|id| id.downcast::<Vec<CertificateDer<'static>>>().ok())
        .and_then(|chain| chain.first().map(|c| c.to_vec()))
        .ok_or_else(|| unreachable(format!("the head at {head} presented no certificate")))?;
    let (mut tx, mut rx) = conn
        .open_bi()
        .await
        .map_err(|e| unreachable(e.to_string()))?;
    let result = joiner_exchange(&mut rx, &mut tx, token, &head_cert, &head.to_string()).await;
    match &result {
        Err(e) if e.to_string().contains("wrong cluster token") => {
            conn.close(3u32.into(), b"wrong cluster token")
        }
        _ => conn.close(0u32.into(), b"done"),
    }
    // A refusal keeps its kind; any other failure of the handshake is the head not admitting us, with why.
    result.map_err(|e| match e.downcast::<Error>() {
        Ok(typed) => typed,
        Err(e) => Error::JoinRefused {
            head: head.to_string(),
            reason: format!("{e:#}"),
        },
    })
}
