//! Cluster trust: the head mints a CA and a certificate per member; every connection after the join is mutual TLS
//! against that CA (rustls with the ring provider). The join itself runs over TLS with an unverified head certificate
//! and is authenticated by both sides proving knowledge of the cluster token (see [`crate::protocol::JoinMsg`]).

use std::sync::Arc;

use anyhow::{Context as _, Result};
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair};
use rkyv::{Archive, Deserialize, Serialize};
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName, UnixTime};
use rustls::{DigitallySignedStruct, SignatureScheme};
use sha2::{Digest, Sha256};

use crate::codec::Wire;

/// The name every cluster certificate is issued for (and clients verify).
#[cfg_attr(
    not(feature = "testing"),
    expect(unreachable_pub, reason = "public through the `testing` feature")
)]
pub const CLUSTER_SERVER_NAME: &str = "ferl.cluster";
const ALPN: &[u8] = b"ferl/1";

/// A member's credentials: the cluster CA and a certificate with its key.
#[derive(Archive, Serialize, Deserialize, Clone, Debug)]
pub struct Credentials {
    /// CA certificate (DER).
    pub ca_der: Vec<u8>,
    /// Member certificate (DER).
    pub cert_der: Vec<u8>,
    /// Member key (PKCS#8 DER).
    pub key_der: Vec<u8>,
}

impl Credentials {
    /// Writes the credentials to `path` with mode 0600.
    pub fn save(&self, path: &std::path::Path) -> Result<()> {
        crate::security::session::write_private(path, &self.to_wire()?)
    }
    /// Reads credentials written by [`Credentials::save`].
    pub fn load(path: &std::path::Path) -> Result<Self> {
        let bytes = std::fs::read(path)
            .with_context(|| format!("reading credentials {}", path.display()))?;
        Self::from_wire(&bytes).with_context(|| format!("credentials file {}", path.display()))
    }
}

/// The cluster certificate authority, held by the head.
pub(crate) struct ClusterCa {
    issuer: CertifiedIssuer<'static, KeyPair>,
}

impl ClusterCa {
    /// Mints a fresh CA.
    pub(crate) fn mint() -> Result<Self> {
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(DnType::CommonName, "ferl cluster CA");
        let issuer = CertifiedIssuer::self_signed(params, KeyPair::generate()?)?;
        Ok(Self { issuer })
    }

    /// Issues a certificate for one member (`who` goes in the subject).
    pub(crate) fn issue(&self, who: &str) -> Result<Credentials> {
        let key = KeyPair::generate()?;
        let mut params = CertificateParams::new(vec![CLUSTER_SERVER_NAME.to_string()])?;
        params.distinguished_name.push(DnType::CommonName, who);
        let cert = params.signed_by(&key, &self.issuer)?;
        Ok(Credentials {
            ca_der: self.issuer.der().to_vec(),
            cert_der: cert.der().to_vec(),
            key_der: key.serialize_der(),
        })
    }
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn roots(creds: &Credentials) -> Result<rustls::RootCertStore> {
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(CertificateDer::from(creds.ca_der.clone()))
        .context("adding the cluster CA")?;
    Ok(roots)
}

fn key(creds: &Credentials) -> PrivateKeyDer<'static> {
    PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(creds.key_der.clone()))
}

/// Server side: present our certificate; accept clients with a cluster certificate, and (for the join only) clients
/// without one — the transport lets such a connection do nothing but the join handshake.
pub(crate) fn server_config(creds: &Credentials) -> Result<rustls::ServerConfig> {
    let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
        Arc::new(roots(creds)?),
        provider(),
    )
    .allow_unauthenticated()
    .build()?;
    let mut cfg = rustls::ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_client_cert_verifier(verifier)
        .with_single_cert(
            vec![CertificateDer::from(creds.cert_der.clone())],
            key(creds),
        )?;
    cfg.alpn_protocols = vec![ALPN.to_vec()];
    Ok(cfg)
}

/// Client side for members: verify the peer against the cluster CA and present our certificate.
#[cfg_attr(
    not(feature = "testing"),
    expect(unreachable_pub, reason = "public through the `testing` feature")
)]
pub fn client_config(creds: &Credentials) -> Result<rustls::ClientConfig> {
    let mut cfg = rustls::ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_root_certificates(roots(creds)?)
        .with_client_auth_cert(
            vec![CertificateDer::from(creds.cert_der.clone())],
            key(creds),
        )?;
    cfg.alpn_protocols = vec![ALPN.to_vec()];
    Ok(cfg)
}

/// Client side for the join: the head's certificate cannot be checked yet; the token proofs authenticate it.
pub(crate) fn join_client_config() -> Result<rustls::ClientConfig> {
    let mut cfg = rustls::ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(TokenAuthenticatedHead(provider())))
        .with_no_client_auth();
    cfg.alpn_protocols = vec![ALPN.to_vec()];
    Ok(cfg)
}

/// Accepts the head's certificate during the join; the handshake's token proofs bind to its hash.
#[derive(Debug)]
struct TokenAuthenticatedHead(Arc<CryptoProvider>);

impl ServerCertVerifier for TokenAuthenticatedHead {
    fn verify_server_cert(
        &self,
        _: &CertificateDer<'_>,
        _: &[CertificateDer<'_>],
        _: &ServerName<'_>,
        _: &[u8],
        _: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }
    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }
    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }
    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// The proof one side of the join sends: `sha256(token ‖ label ‖ nonce ‖ sha256(head cert))`.
#[cfg_attr(
    not(feature = "testing"),
    expect(unreachable_pub, reason = "public through the `testing` feature")
)]
pub fn join_proof(token: &str, label: &str, nonce: &[u8], head_cert_der: &[u8]) -> Vec<u8> {
    let mut h = Sha256::new();
    h.update(token.as_bytes());
    h.update([0]);
    h.update(label.as_bytes());
    h.update([0]);
    h.update(nonce);
    h.update(Sha256::digest(head_cert_der));
    h.finalize().to_vec()
}

/// Compares two byte strings in time independent of where they differ.
pub(crate) fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// A fresh random token (hex, 32 bytes of entropy).
pub(crate) fn new_token() -> String {
    let bytes: [u8; 32] = rand::random();
    hex::encode(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guarantee_7_proofs_depend_on_token_nonce_and_certificate() {
        let p = join_proof("t", "head", b"n", b"cert");
        assert!(constant_time_eq(
            &p,
            &join_proof("t", "head", b"n", b"cert")
        ));
        assert!(!constant_time_eq(
            &p,
            &join_proof("u", "head", b"n", b"cert")
        ));
        assert!(!constant_time_eq(
            &p,
            &join_proof("t", "node", b"n", b"cert")
        ));
        assert!(!constant_time_eq(
            &p,
            &join_proof("t", "head", b"m", b"cert")
        ));
        assert!(!constant_time_eq(
            &p,
            &join_proof("t", "head", b"n", b"other")
        ));
    }

    #[test]
    fn minted_credentials_build_configs() {
        let ca = ClusterCa::mint().unwrap();
        let creds = ca.issue("node-1").unwrap();
        server_config(&creds).unwrap();
        client_config(&creds).unwrap();
        join_client_config().unwrap();
        assert_ne!(new_token(), new_token());
    }
}
