//! Layer 3, security: the cluster's trust material and the files that hold it. [`tls`] mints the cluster CA and
//! member certificates and builds the rustls configurations; [`session`] keeps a head's or node's private folder
//! (token, address, logs) with private permissions. Uses only the codec and protocol below it.

pub(crate) mod session;
pub(crate) mod tls;
