//! The message traits: one Rust type per message, naming its reply (or item) type and its name on the wire.

use super::Wire;

/// A request type: one Rust type per message, with the type of its reply.
///
/// Implement it by hand or with [`message!`](crate::message) (`ferl_wire::message!(Add => u64);`, also reachable as
/// `ferl_runtime::message!`).
pub trait Message: Wire {
    /// The reply type.
    type Reply: Wire;
    /// Name on the wire; unique per message type (the macro uses the module path).
    const NAME: &'static str;
}

/// A request answered by a stream of items.
pub trait StreamMessage: Wire {
    /// The item type.
    type Item: Wire;
    /// Name on the wire.
    const NAME: &'static str;
}

/// Implements [`Message`] for a type: `message!(Add => u64);` (several may be listed, separated by `;`).
#[macro_export]
macro_rules! message {
    ($($msg:ty => $reply:ty);+ $(;)?) => {$(
        impl $crate::Message for $msg {
            type Reply = $reply;
            const NAME: &'static str = concat!(module_path!(), "::", stringify!($msg));
        }
    )+};
}

/// Implements [`StreamMessage`] for a type: `stream_message!(Count => u64);`.
#[macro_export]
macro_rules! stream_message {
    ($($msg:ty => $item:ty);+ $(;)?) => {$(
        impl $crate::StreamMessage for $msg {
            type Item = $item;
            const NAME: &'static str = concat!(module_path!(), "::", stringify!($msg));
        }
    )+};
}
