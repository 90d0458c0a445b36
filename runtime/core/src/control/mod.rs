//! Layer 6, control: what keeps a cluster together, built from actors of the layer below.
//!
//! - pure state, no I/O: [`placement`] (resource groups onto nodes), [`membership`] (liveness from heartbeats),
//!   [`supervision`] (an actor's lifecycle), [`resources`] (what a node offers);
//! - the agents: [`head`] (the head actor), [`node`] (the node agent, which starts worker processes) and [`worker`]
//!   (their side);
//! - [`config`] (the runtime's one configuration, read by the bootstrap layer and passed down);
//! - [`join`] (the token handshake that admits a member), shipping ([`binary`], [`blobs`]) and the object store
//!   ([`objects`]).

/// Implements `Message` under a fixed wire name, `PATH::Type`: the runtime's own messages keep the names they had
/// before the layers moved their modules (`ferl_runtime::binary::FetchFileChunk`), so the wire is unchanged.
macro_rules! pinned_message {
    ($path:literal; $($msg:ty => $reply:ty);+ $(;)?) => {$(
        impl crate::codec::Message for $msg {
            type Reply = $reply;
            const NAME: &'static str = concat!($path, "::", stringify!($msg));
        }
    )+};
}

pub(crate) mod binary;
pub(crate) mod blobs;
pub(crate) mod config;
pub(crate) mod head;
pub(crate) mod join;
pub(crate) mod membership;
pub(crate) mod node;
pub(crate) mod objects;
pub(crate) mod placement;
pub(crate) mod resources;
pub(crate) mod supervision;
pub(crate) mod worker;
