//! The error every public call returns, the bootstrap functions (`init`, `connect`, `start_head`, `start_node`)
//! included. Failures name the actor and node involved. Kinds a caller may want to act on (placement infeasible
//! against busy, a taken name, a refused join, a timeout, a dead actor) are variants of their own; failures of the
//! head's control messages cross the wire as a [`RemoteErrorKind`] so they keep their kind in the caller.

use crate::protocol::{RemoteError, RemoteErrorKind};

/// What went wrong with a call, a spawn, a cluster operation or starting a cluster. New kinds may be added.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The actor is gone: its worker or node died, it was killed, or its group was removed.
    #[error("actor {actor} on {node} died: {reason}")]
    ActorDied {
        /// Actor type and id.
        actor: String,
        /// The actor's id (as in [`crate::ActorRef::id`]).
        id: u64,
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
    /// A resource request this cluster can never satisfy (its nodes together lack what is asked, or the strategy
    /// cannot be met with its nodes): fails at once, never waits. The message names what is missing.
    #[error("{message}")]
    Infeasible {
        /// What is missing.
        message: String,
    },
    /// A resource request the cluster could satisfy, but not with what is free: a resource group still waiting
    /// when its timeout ran out, or an actor's own reservation (which does not wait).
    #[error("{message}")]
    Busy {
        /// What is held and for how long it waited.
        message: String,
    },
    /// An actor of this name already exists in the namespace.
    #[error("an actor named `{name}` already exists in namespace `{namespace}`")]
    NameTaken {
        /// The namespace.
        namespace: String,
        /// The name.
        name: String,
    },
    /// The head refused to admit this process (a wrong token, a broken handshake); a head that cannot be reached or
    /// does not finish the handshake in time is [`Error::Unreachable`].
    #[error("joining the cluster at {head} was refused: {reason}")]
    JoinRefused {
        /// The head's address.
        head: String,
        /// Why (the head's reason, or what this side found wrong).
        reason: String,
    },
    /// Starting or joining a cluster failed before any cluster operation (binding a socket, the session folder,
    /// credentials, a bad address).
    #[error("{0}")]
    Startup(String),
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

    /// The kind this error has on the wire, when a handler's failure of this kind should keep it in the caller
    /// (placement and names); `None`: a plain handler failure.
    pub(crate) fn remote_kind(&self) -> Option<RemoteErrorKind> {
        match self.root() {
            Error::Infeasible { .. } => Some(RemoteErrorKind::Infeasible),
            Error::Busy { .. } => Some(RemoteErrorKind::Busy),
            Error::NameTaken { .. } => Some(RemoteErrorKind::NameTaken),
            _ => None,
        }
    }

    /// The kind of a handler's failure: the runtime [`Error`] it carries decides (see [`Error::remote_kind`]), else
    /// [`RemoteErrorKind::Handler`].
    pub(crate) fn handler_kind(e: &anyhow::Error) -> RemoteErrorKind {
        e.chain()
            .find_map(|c| c.downcast_ref::<Error>().and_then(Error::remote_kind))
            .unwrap_or(RemoteErrorKind::Handler)
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
            Some(RemoteError {
                kind: RemoteErrorKind::Infeasible,
                message,
            }) => Error::Infeasible { message },
            Some(RemoteError {
                kind: RemoteErrorKind::Busy,
                message,
            }) => Error::Busy { message },
            Some(RemoteError {
                kind: RemoteErrorKind::NameTaken,
                message,
            }) => name_taken(&message),
            Some(e) => Error::Remote {
                actor: actor.to_string(),
                message: e.message,
            },
            None => Error::Transport(format!("actor {actor} ended a call without a reply")),
        }
    }
}

/// The `NameTaken` a remote message describes (its `Display` text, after any prefix); the whole message as the
/// name when it has another form (`Cluster::spawn` sets both fields from its request anyway).
fn name_taken(message: &str) -> Error {
    let parsed = message
        .split_once("an actor named `")
        .and_then(|(_, rest)| rest.split_once("` already exists in namespace `"))
        .and_then(|(name, rest)| Some((name, rest.strip_suffix('`')?)));
    match parsed {
        Some((name, namespace)) => Error::NameTaken {
            namespace: namespace.into(),
            name: name.into(),
        },
        None => Error::NameTaken {
            namespace: String::new(),
            name: message.into(),
        },
    }
}

impl From<crate::codec::WireError> for Error {
    fn from(e: crate::codec::WireError) -> Self {
        Error::Codec(e.to_string())
    }
}

/// Result with the runtime's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn typed_kinds_cross_the_wire_and_come_back_typed() {
        let taken = Error::NameTaken {
            namespace: "ns".into(),
            name: "a`b".into(),
        };
        let cases = [
            Error::Infeasible {
                message: "no node has 8 GPU".into(),
            },
            Error::Busy {
                message: "timed out".into(),
            },
            taken.clone(),
        ];
        for e in cases {
            let kind = Error::handler_kind(&anyhow::Error::new(e.clone()).context("relayed"));
            assert_eq!(Some(kind), e.remote_kind());
            let back = Error::from_remote(
                1,
                Some(RemoteError {
                    kind,
                    message: format!("actor x (1) failed on M: {e}"),
                }),
            );
            match (&e, &back) {
                (Error::NameTaken { .. }, Error::NameTaken { namespace, name }) => {
                    assert_eq!((namespace.as_str(), name.as_str()), ("ns", "a`b"))
                }
                (Error::Infeasible { .. }, Error::Infeasible { message })
                | (Error::Busy { .. }, Error::Busy { message }) => {
                    assert!(message.ends_with(&e.to_string()))
                }
                _ => panic!("{e:?} came back as {back:?}"),
            }
        }
        let plain = anyhow::anyhow!("boom");
        assert_eq!(Error::handler_kind(&plain), RemoteErrorKind::Handler);
    }

    #[test]
    fn the_new_kinds_are_appended_so_the_old_ones_keep_their_wire_tags() {
        use crate::codec::Wire;
        use RemoteErrorKind::*;
        let kinds = [
            NoSuchActor,
            NoSuchHandler,
            Handler,
            Decode,
            Infeasible,
            Busy,
            NameTaken,
        ];
        assert_eq!(kinds.map(|k| k as u8), [0, 1, 2, 3, 4, 5, 6]);
        for kind in kinds {
            let e = RemoteError {
                kind,
                message: "m".into(),
            };
            assert_eq!(RemoteError::from_wire(&e.to_wire().unwrap()).unwrap(), e);
        }
    }
}
