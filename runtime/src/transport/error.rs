//! The error every public call returns. Failures name the actor and node involved.

use crate::protocol::{RemoteError, RemoteErrorKind};

/// What went wrong with a call, a spawn or a cluster operation.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    /// The actor is gone: its worker or node died, it was killed, or its group was removed.
    #[error("actor {actor} on {node} died: {reason}")]
    ActorDied {
        /// Actor type and id.
        actor: String,
        /// Node name.
        node: String,
        /// Why.
        reason: String,
    },
    /// The actor's handler failed (or panicked, or had no handler for the message).
    #[error("{message}")]
    Remote {
        /// Actor type and id.
        actor: String,
        /// The remote message (names actor and message type).
        message: String,
    },
    /// The connection to the actor's process was lost (internal; reported to users as `ActorDied`).
    #[error("lost actor {actor}: {reason}")]
    Lost {
        /// Actor id.
        actor: u64,
        /// Why.
        reason: String,
    },
    /// A cluster process could not be reached.
    #[error("cannot reach cluster process at {addr}: {reason}")]
    Unreachable {
        /// Address.
        addr: String,
        /// Why.
        reason: String,
    },
    /// A message could not be encoded or decoded.
    #[error("codec: {0}")]
    Codec(String),
    /// The transport failed.
    #[error("transport: {0}")]
    Transport(String),
    /// A control-plane request failed (placement, spawn, lookup...).
    #[error("{0}")]
    Cluster(String),
    /// A call given a deadline with [`crate::actor::actor_ref::Call::timeout`] had no reply in time (the actor may still
    /// handle the message; its reply is dropped).
    #[error("{message} to actor {actor} on {node} had no reply within {after:?}")]
    Timeout {
        /// Actor type and id.
        actor: String,
        /// Node name.
        node: String,
        /// The message type.
        message: String,
        /// The deadline.
        after: std::time::Duration,
    },
    /// A call to one rank of a worker group failed ([`crate::WorkerGroup::call_each`]); `cause` is what failed.
    #[error("rank {rank} ({actor} on {node}): {cause}")]
    Rank {
        /// The rank.
        rank: usize,
        /// Actor type and id.
        actor: String,
        /// Node name.
        node: String,
        /// The rank's own error.
        cause: Box<Error>,
    },
}

impl Error {
    /// The error itself, or for [`Error::Rank`] the rank's own error (what a caller matches on).
    pub fn root(&self) -> &Error {
        match self {
            Error::Rank { cause, .. } => cause.root(),
            other => other,
        }
    }

    /// Whether the actor (or its connection) is gone, rather than a handler having failed.
    pub fn is_actor_death(&self) -> bool {
        matches!(self.root(), Error::ActorDied { .. } | Error::Lost { .. })
    }

    pub(crate) fn from_remote(actor: u64, error: Option<RemoteError>) -> Self {
        match error {
            Some(RemoteError {
                kind: RemoteErrorKind::NoSuchActor,
                message,
            }) => Error::Lost {
                actor,
                reason: message,
            },
            Some(e) => Error::Remote {
                actor: actor.to_string(),
                message: e.message,
            },
            None => Error::Transport(format!("actor {actor} ended a call without a reply")),
        }
    }
}

impl From<crate::codec::WireError> for Error {
    fn from(e: crate::codec::WireError) -> Self {
        Error::Codec(e.to_string())
    }
}

/// Result with the runtime's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
