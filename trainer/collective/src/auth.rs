//! Authenticating the collectives' TCP connections with a per-job secret ([`JobSecret`]).
//!
//! Invariants (tests name them):
//! 1. Every TCP connection of this crate (the rendezvous store's, the mesh's) completes this handshake before any
//!    request, address, shared-memory offer or tensor byte travels over it; a peer that fails it is dropped.
//! 2. The secret never travels: each side proves it holds the secret with HMAC-SHA256 over both sides' fresh nonces,
//!    a context label (which kind of connection, which group) and the handshake's payloads (e.g. the ranks), so a
//!    proof cannot be replayed on another connection, in another role or for another group.
//! 3. The connecting side proves first, so a listener never hands an unauthenticated peer anything derived from the
//!    secret; the listener proves back only to a peer that passed (the check is mutual). Proofs are compared in
//!    constant time.
//! 4. Every handshake message has a fixed size and every handshake read ends by a deadline, so a silent, slow or
//!    garbage peer costs a listener at most its handshake time-out and a few bytes of memory.
//!
//! Wire: initiator → `MAGIC(8) | hello | nonce_i(32)`; responder → `nonce_r(32) | reply`; initiator → `proof_i(32)`;
//! responder → `status(1)` (1 accepted, 0 refused), and when accepted `proof_r(32)`. `hello` and `reply` have sizes
//! fixed by the kind of connection.

use anyhow::{anyhow, bail, Context, Result};
use hmac::{Hmac, Mac};
use sha2::Sha256;
use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The environment variable launcher runs (torchrun, SLURM) read the job secret from, as hex.
pub const JOB_SECRET_ENV: &str = "FERL_JOB_SECRET";
/// How long a listener waits for an accepted peer to complete its handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
const MIN_SECRET_BYTES: usize = 16;
const MAX_SECRET_BYTES: usize = 64;
const NONCE_BYTES: usize = 32;
const PROOF_BYTES: usize = 32;
const MAGIC: [u8; 8] = *b"FERLAUTH";
const ACCEPTED: u8 = 1;
const REFUSED: u8 = 0;
/// Most handshakes one listener runs at once; connections beyond it are closed at once.
pub const MAX_HANDSHAKING: usize = 64;
/// Part of the error text whenever the two sides hold different secrets.
pub(crate) const WRONG_SECRET: &str = "wrong job secret";

/// A per-job secret shared by every rank of one job: 16 to 64 random bytes (32 from [`JobSecret::generate`]). Its
/// `Debug` form never shows the bytes.
#[derive(Clone, PartialEq, Eq)]
pub struct JobSecret(Vec<u8>);

impl std::fmt::Debug for JobSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("JobSecret(<redacted>)")
    }
}

impl JobSecret {
    /// A fresh secret of 32 bytes from the operating system's random source.
    pub fn generate() -> Result<Self> {
        Ok(Self(random_bytes::<32>()?.to_vec()))
    }

    /// Parses `text` as hex (e.g. `openssl rand -hex 32`); surrounding white space is ignored.
    pub fn from_hex(text: &str) -> Result<Self> {
        let bytes = hex::decode(text.trim()).map_err(|e| {
            anyhow!("the job secret is not hex ({e}); generate one with `openssl rand -hex 32`")
        })?;
        if !(MIN_SECRET_BYTES..=MAX_SECRET_BYTES).contains(&bytes.len()) {
            bail!(
                "the job secret has {} bytes; it needs {MIN_SECRET_BYTES} to {MAX_SECRET_BYTES} \
                 (`openssl rand -hex 32` gives 32)",
                bytes.len()
            );
        }
        Ok(Self(bytes))
    }

    /// The secret as lowercase hex, the form [`JobSecret::from_hex`] and [`JOB_SECRET_ENV`] take.
    pub fn to_hex(&self) -> String {
        hex::encode(&self.0)
    }

    /// The secret in [`JOB_SECRET_ENV`]; an error names the variable when it is unset or malformed.
    pub fn from_env() -> Result<Self> {
        match std::env::var(JOB_SECRET_ENV) {
            Ok(text) => Self::from_hex(&text).with_context(|| format!("{JOB_SECRET_ENV} is malformed")),
            Err(_) => bail!(
                "{JOB_SECRET_ENV} is not set: every rank of a torchrun/SLURM launch needs the same per-job secret \
                 to authenticate the rendezvous store and the collective group; \
                 run `export {JOB_SECRET_ENV}=$(openssl rand -hex 32)` before launching"
            ),
        }
    }

    fn proof(&self, context: &[u8], role: &[u8], parts: [&[u8]; 4]) -> Hmac<Sha256> {
        let mut mac =
            Hmac::<Sha256>::new_from_slice(&self.0).expect("HMAC takes keys of any length");
        for part in [context, role].into_iter().chain(parts) {
            mac.update(&(part.len() as u32).to_le_bytes());
            mac.update(part);
        }
        mac
    }
}

/// `N` bytes from the operating system's random source.
pub(crate) fn random_bytes<const N: usize>() -> Result<[u8; N]> {
    let mut bytes = [0u8; N];
    let mut filled = 0;
    while filled < N {
        // SAFETY: filling the unfilled tail of a local buffer of the given length.
        let n = unsafe {
            libc::getrandom(
                bytes[filled..].as_mut_ptr() as *mut libc::c_void,
                N - filled,
                0,
            )
        };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() != ErrorKind::Interrupted {
                return Err(e).context("reading random bytes (getrandom)");
            }
        } else {
            filled += n as usize;
        }
    }
    Ok(bytes)
}

/// Bounds how many handshakes a listener runs at once (at most [`MAX_HANDSHAKING`]).
#[derive(Default)]
pub(crate) struct HandshakeLimit(AtomicUsize);

impl HandshakeLimit {
    /// A ticket for one more handshake, or `None` when [`MAX_HANDSHAKING`] are running.
    pub(crate) fn enter(self: &Arc<Self>) -> Option<HandshakeTicket> {
        if self.0.fetch_add(1, Ordering::AcqRel) >= MAX_HANDSHAKING {
            self.0.fetch_sub(1, Ordering::AcqRel);
            return None;
        }
        Some(HandshakeTicket(self.clone()))
    }

    /// Handshakes running now.
    #[cfg(test)]
    pub(crate) fn running(&self) -> usize {
        self.0.load(Ordering::Acquire)
    }
}

/// One running handshake's place in its [`HandshakeLimit`], given back on drop.
pub(crate) struct HandshakeTicket(Arc<HandshakeLimit>);

impl Drop for HandshakeTicket {
    fn drop(&mut self) {
        self.0 .0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// What both sides of one kind of connection bind their proofs to.
pub(crate) struct Handshake<'a> {
    /// The job's secret.
    pub secret: &'a JobSecret,
    /// The kind of connection and its group, e.g. `ferl-collective-store-v1`.
    pub context: &'a [u8],
    /// Bound on the whole handshake.
    pub timeout: Duration,
}

impl Handshake<'_> {
    /// The connecting side: sends `hello`, proves the secret, checks the listener's proof, and returns the
    /// listener's `reply` (`reply_len` bytes).
    pub(crate) fn initiate(
        &self,
        stream: &mut TcpStream,
        hello: &[u8],
        reply_len: usize,
    ) -> Result<Vec<u8>> {
        let deadline = Instant::now() + self.timeout;
        let nonce_i = random_bytes::<NONCE_BYTES>()?;
        let mut first = MAGIC.to_vec();
        first.extend_from_slice(hello);
        first.extend_from_slice(&nonce_i);
        write_by(stream, &first, deadline)?;
        let mut answer = vec![0u8; NONCE_BYTES + reply_len];
        read_by(stream, &mut answer, deadline)?;
        let (nonce_r, reply) = answer.split_at(NONCE_BYTES);
        let parts = [hello, reply, &nonce_i[..], nonce_r];
        let proof = self
            .secret
            .proof(self.context, b"initiator", parts)
            .finalize()
            .into_bytes();
        write_by(stream, &proof, deadline)?;
        let mut status = [0u8; 1 + PROOF_BYTES];
        read_by(stream, &mut status[..1], deadline)?;
        match status[0] {
            ACCEPTED => {}
            REFUSED => bail!(
                "refused this process's proof: {WRONG_SECRET} (the peer holds a different one)"
            ),
            other => bail!(
                "the peer answered garbage (status byte {other:#04x}): not a ferl-collective handshake"
            ),
        }
        read_by(stream, &mut status[1..], deadline)?;
        self.secret
            .proof(self.context, b"responder", parts)
            .verify_slice(&status[1..])
            .map_err(|_| {
                anyhow!("the peer's proof failed: {WRONG_SECRET} (the peer holds a different one)")
            })?;
        Ok(reply.to_vec())
    }

    /// The listening side: reads the peer's `hello` (`hello_len` bytes), lets `answer` check it and choose the
    /// reply, then checks the peer's proof and proves back. Returns the hello of a peer that passed.
    pub(crate) fn respond(
        &self,
        stream: &mut TcpStream,
        hello_len: usize,
        answer: impl FnOnce(&[u8]) -> Result<Vec<u8>>,
    ) -> Result<Vec<u8>> {
        let deadline = Instant::now() + self.timeout;
        let mut first = vec![0u8; MAGIC.len() + hello_len + NONCE_BYTES];
        read_by(stream, &mut first, deadline)?;
        if first[..MAGIC.len()] != MAGIC {
            bail!("not a ferl-collective handshake (bad magic)");
        }
        let (hello, nonce_i) = first[MAGIC.len()..].split_at(hello_len);
        let reply = answer(hello)?;
        let nonce_r = random_bytes::<NONCE_BYTES>()?;
        write_by(stream, &[&nonce_r[..], &reply[..]].concat(), deadline)?;
        let mut proof = [0u8; PROOF_BYTES];
        read_by(stream, &mut proof, deadline)?;
        let parts = [hello, &reply[..], nonce_i, &nonce_r[..]];
        if self
            .secret
            .proof(self.context, b"initiator", parts)
            .verify_slice(&proof)
            .is_err()
        {
            let _ = write_by(stream, &[REFUSED], deadline);
            bail!("{WRONG_SECRET} (its proof does not match this job's secret)");
        }
        let mine = self
            .secret
            .proof(self.context, b"responder", parts)
            .finalize()
            .into_bytes();
        write_by(stream, &[&[ACCEPTED][..], &mine].concat(), deadline)?;
        Ok(hello.to_vec())
    }
}

/// The time left before `deadline`, as a socket time-out (never zero, which would mean "no time-out").
fn left(deadline: Instant) -> Result<Duration> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        bail!("handshake timed out");
    }
    Ok(left)
}

/// Reads exactly `buf.len()` bytes, failing at `deadline` however slowly the peer trickles them.
fn read_by(stream: &mut TcpStream, buf: &mut [u8], deadline: Instant) -> Result<()> {
    let mut got = 0;
    while got < buf.len() {
        stream.set_read_timeout(Some(left(deadline)?))?;
        match stream.read(&mut buf[got..]) {
            Ok(0) => bail!("the peer closed the connection during the handshake"),
            Ok(n) => got += n,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                bail!("handshake timed out")
            }
            Err(e) => return Err(e).context("handshake"),
        }
    }
    Ok(())
}

fn write_by(stream: &mut TcpStream, bytes: &[u8], deadline: Instant) -> Result<()> {
    stream.set_write_timeout(Some(left(deadline)?))?;
    stream.write_all(bytes).context("handshake")
}

#[cfg(test)]
#[path = "auth_tests.rs"]
mod tests;
