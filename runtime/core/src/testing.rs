//! Test hooks, behind the `testing` feature (off by default, so production binaries do not link them): internals
//! that the runtime's own tests and fuzzers drive directly, from below the facade. The test actors are in
//! [`crate::testbed`]. Add `features = ["testing"]` to a dev-dependency on `ferl-runtime` to use them.

/// The join handshake (guarantee 7): both sides' exchanges, for the fuzzers, and a joiner's whole join.
pub use crate::control::join::{head_exchange, join, joiner_exchange};
/// Cluster credentials and TLS configurations (guarantee 7).
pub use crate::security::tls::{client_config, join_proof, Credentials, CLUSTER_SERVER_NAME};
/// The QUIC client configuration a joiner uses before it has credentials.
pub use crate::transport::join_client_config;
