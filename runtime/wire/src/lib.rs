//! # ferl-wire: what crosses the wire between ferl processes
//!
//! The bottom two layers of ferl's runtime (design decision 15), as a crate of their own so that crates which only
//! define messages depend on them without pulling in QUIC:
//!
//! - [`codec`]: rkyv encoding validated with bytecheck on receipt ([`Wire`]), frames ([`encode_frame`],
//!   [`read_frame`]), the pool of large buffers ([`codec::pool`]), [`SharedBytes`] (a byte field decoded without a
//!   copy) and the [`Message`] / [`StreamMessage`] traits with their macros [`message!`] and [`stream_message!`];
//! - [`protocol`]: every message type the runtime itself sends (transport frames, the join handshake, control
//!   messages), as plain data.
//!
//! `codec` uses nothing of `protocol`. `ferl_runtime` re-exports what drivers need (`ferl_runtime::Message`,
//! `ferl_runtime::message!`, `ferl_runtime::SharedBytes`...): the traits are the same, so a message type defined
//! against this crate is sent with `ferl_runtime::ActorRef::call` as is.

pub mod codec;
pub mod protocol;

pub use codec::{
    encode_frame, read_frame, read_message, FrameError, Message, SharedBytes, StreamMessage, Wire,
    WireError, DEFAULT_MAX_FRAME, FRAME_HEADER, WIRE_VERSION,
};
