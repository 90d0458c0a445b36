//! Actors and messages: the [`Actor`] trait, one type per message with a [`Handler`] (or [`StreamHandler`]) for it,
//! and the registry that finds actor types by name (filled by [`register_actor!`](crate::register_actor) through
//! `inventory`, and growable at run time with [`register`], so plugins can add types).
//!
//! Handlers take `&self`: an actor handles one message at a time unless spawned with `max_concurrency > 1`, so state
//! that handlers change lives behind a `Mutex` (uncontended in the default, sequential case).

use std::any::Any;
use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, OnceLock, RwLock};

use futures::future::BoxFuture;
use rkyv::util::AlignedVec;

use crate::actor::process::Process;
use crate::transport::delivery::RawSink;
use crate::transport::error::Error;

pub(crate) mod actor_ref;
pub(crate) mod host;
pub(crate) mod process;

use crate::codec::Wire;
use crate::protocol::{RemoteError, RemoteErrorKind};

pub(crate) use crate::codec::{Message, StreamMessage};

/// The name [`register_actor!`](crate::register_actor) and [`actor_dispatch!`](crate::actor_dispatch) derive for
/// an actor type, as [`message!`](crate::message) does for messages: the registering module's path and the type
/// as written (`my_crate::actors::Summer`). Implemented by those macros only.
#[diagnostic::on_unimplemented(
    message = "actor type `{Self}` is not registered",
    label = "register it with `ferl_runtime::register_actor!({Self}, calls: [...])`"
)]
pub trait ActorName {
    /// The derived name.
    const DERIVED_NAME: &'static str;
}

/// An actor type: state built by an async constructor from wire-encoded arguments, living in one process.
pub trait Actor: ActorName + Send + Sync + Sized + 'static {
    /// Constructor arguments (sent to the worker process that builds the actor).
    type Args: Wire;
    /// Name the registry knows this type by: by default the name the registration macro derives
    /// ([`ActorName`]); set it to keep a fixed name (one that does not move with the code).
    const NAME: &'static str = <Self as ActorName>::DERIVED_NAME;
    /// Builds the actor; re-run on every restart.
    fn start(args: Self::Args, ctx: &Context) -> impl Future<Output = anyhow::Result<Self>> + Send;
}

/// An actor that answers message `M`.
pub trait Handler<M: Message>: Actor {
    /// Handles one message; an error reaches the caller as [`crate::Error::Remote`] (or, when it carries a runtime
    /// `Error` of a kind that crosses the wire, such as `Infeasible`, `Busy` or `NameTaken`, as that kind).
    fn handle(
        &self,
        msg: M,
        ctx: &Context,
    ) -> impl Future<Output = anyhow::Result<M::Reply>> + Send;
}

/// An actor that answers message `M` with a stream of items.
pub trait StreamHandler<M: StreamMessage>: Actor {
    /// Sends items through `items`; returning ends the stream (an error ends it with that error).
    fn handle_stream(
        &self,
        msg: M,
        items: ItemSink<M::Item>,
        ctx: &Context,
    ) -> impl Future<Output = anyhow::Result<()>> + Send;
}

/// What a handler knows about where it runs.
#[derive(Clone)]
pub struct Context {
    pub(crate) actor_id: u64,
    pub(crate) process: Arc<Process>,
}

impl Context {
    /// This actor's id.
    pub fn actor_id(&self) -> u64 {
        self.actor_id
    }
}

/// Sends the items of a streaming reply.
pub struct ItemSink<T> {
    raw: RawSink,
    _item: std::marker::PhantomData<fn(T)>,
}

impl<T: Wire> ItemSink<T> {
    pub(crate) fn new(raw: RawSink) -> Self {
        Self {
            raw,
            _item: std::marker::PhantomData,
        }
    }
    /// Sends one item; fails when the caller has gone away.
    pub async fn send(&self, item: T) -> anyhow::Result<()> {
        let bytes = item.to_wire()?;
        self.raw.item(bytes).await
    }
}

/// A type-erased actor instance.
pub type AnyActor = Arc<dyn Any + Send + Sync>;
/// A type-erased call handler: decode, handle, encode.
pub type CallFn =
    fn(AnyActor, AlignedVec, Context) -> BoxFuture<'static, Result<AlignedVec, RemoteError>>;
/// A type-erased stream handler.
pub type StreamFn =
    fn(AnyActor, AlignedVec, Context, RawSink) -> BoxFuture<'static, Result<(), RemoteError>>;
/// A type-erased constructor.
pub type ConstructFn = fn(AlignedVec, Context) -> BoxFuture<'static, anyhow::Result<AnyActor>>;

/// The handler table of one actor type, keyed by message name.
pub struct Dispatch {
    /// Call/tell handlers.
    pub calls: HashMap<&'static str, CallFn>,
    /// Stream handlers.
    pub streams: HashMap<&'static str, StreamFn>,
}

impl Dispatch {
    /// Builds a table from entries made by [`call_entry`] and [`stream_entry`].
    pub fn new(calls: Vec<(&'static str, CallFn)>, streams: Vec<(&'static str, StreamFn)>) -> Self {
        Self {
            calls: calls.into_iter().collect(),
            streams: streams.into_iter().collect(),
        }
    }
}

/// An actor type whose handler table is known (implemented by the registration macros).
pub trait Dispatchable: Actor {
    /// The handler table.
    fn dispatch() -> &'static Dispatch;
}

fn remote(kind: RemoteErrorKind, message: String) -> RemoteError {
    RemoteError { kind, message }
}

/// The table entry for `A: Handler<M>`.
pub fn call_entry<A: Handler<M>, M: Message>() -> (&'static str, CallFn) {
    (M::NAME, |actor, bytes, ctx| {
        Box::pin(async move {
            let actor = actor
                .downcast::<A>()
                .map_err(|_| remote(RemoteErrorKind::Decode, "actor type mismatch".into()))?;
            let msg = M::from_wire_owned(bytes).map_err(|e| {
                remote(
                    RemoteErrorKind::Decode,
                    format!("actor {} could not decode {}: {e}", A::NAME, M::NAME),
                )
            })?;
            let reply = actor.handle(msg, &ctx).await.map_err(|e| {
                remote(
                    Error::handler_kind(&e),
                    format!(
                        "actor {} ({}) failed on {}: {e:#}",
                        A::NAME,
                        ctx.actor_id,
                        M::NAME
                    ),
                )
            })?;
            reply
                .to_wire()
                .map_err(|e| remote(RemoteErrorKind::Decode, e.to_string()))
        })
    })
}

/// The table entry for `A: StreamHandler<M>`.
pub fn stream_entry<A: StreamHandler<M>, M: StreamMessage>() -> (&'static str, StreamFn) {
    (M::NAME, |actor, bytes, ctx, sink| {
        Box::pin(async move {
            let actor = actor
                .downcast::<A>()
                .map_err(|_| remote(RemoteErrorKind::Decode, "actor type mismatch".into()))?;
            let msg = M::from_wire_owned(bytes).map_err(|e| {
                remote(
                    RemoteErrorKind::Decode,
                    format!("actor {} could not decode {}: {e}", A::NAME, M::NAME),
                )
            })?;
            actor
                .handle_stream(msg, ItemSink::new(sink), &ctx)
                .await
                .map_err(|e| {
                    remote(
                        Error::handler_kind(&e),
                        format!(
                            "actor {} ({}) failed on {}: {e:#}",
                            A::NAME,
                            ctx.actor_id,
                            M::NAME
                        ),
                    )
                })
        })
    })
}

fn construct<A: Dispatchable>(
    args: AlignedVec,
    ctx: Context,
) -> BoxFuture<'static, anyhow::Result<AnyActor>> {
    Box::pin(async move {
        let args = A::Args::from_wire(&args)
            .map_err(|e| anyhow::anyhow!("arguments of actor type {}: {e}", A::NAME))?;
        let actor = A::start(args, &ctx).await?;
        Ok(Arc::new(actor) as AnyActor)
    })
}

/// How the registry builds and dispatches one actor type.
#[derive(Clone, Copy)]
pub struct ActorFactory {
    /// Registered name ([`Actor::NAME`]).
    pub name: &'static str,
    /// Constructor.
    pub construct: ConstructFn,
    /// Handler table.
    pub dispatch: fn() -> &'static Dispatch,
}

impl ActorFactory {
    /// The factory of `A` (usable in `inventory::submit!`).
    pub const fn of<A: Dispatchable>() -> Self {
        Self {
            name: A::NAME,
            construct: construct::<A>,
            dispatch: A::dispatch,
        }
    }
}

inventory::collect!(ActorFactory);

fn registry() -> &'static RwLock<HashMap<&'static str, ActorFactory>> {
    static REGISTRY: OnceLock<RwLock<HashMap<&'static str, ActorFactory>>> = OnceLock::new();
    REGISTRY.get_or_init(|| {
        RwLock::new(
            inventory::iter::<ActorFactory>
                .into_iter()
                .map(|f| (f.name, *f))
                .collect(),
        )
    })
}

/// Adds an actor type at run time (plugins); replaces a type of the same name.
pub fn register(factory: ActorFactory) {
    registry()
        .write()
        .expect("registry lock")
        .insert(factory.name, factory);
}

/// Finds an actor type by name.
pub fn lookup(name: &str) -> Option<ActorFactory> {
    registry().read().expect("registry lock").get(name).copied()
}

/// Names of every registered actor type, sorted.
pub fn registered_names() -> Vec<&'static str> {
    let mut names: Vec<_> = registry()
        .read()
        .expect("registry lock")
        .keys()
        .copied()
        .collect();
    names.sort_unstable();
    names
}

/// Gives an actor type its handler table without registering it by name (for actors only hosted in-process).
#[macro_export]
macro_rules! actor_dispatch {
    ($actor:ty $(, calls: [$($m:ty),* $(,)?])? $(, streams: [$($s:ty),* $(,)?])? $(,)?) => {
        impl $crate::ActorName for $actor {
            const DERIVED_NAME: &'static str = concat!(module_path!(), "::", stringify!($actor));
        }
        impl $crate::Dispatchable for $actor {
            fn dispatch() -> &'static $crate::Dispatch {
                static TABLE: ::std::sync::OnceLock<$crate::Dispatch> = ::std::sync::OnceLock::new();
                TABLE.get_or_init(|| {
                    $crate::Dispatch::new(
                        vec![$($($crate::call_entry::<$actor, $m>()),*)?],
                        vec![$($($crate::stream_entry::<$actor, $s>()),*)?],
                    )
                })
            }
        }
    };
}

/// Registers an actor type by name with its messages, from any crate:
/// `ferl_runtime::register_actor!(Counter, calls: [Add, Get], streams: [CountTo]);`. The name is derived as
/// [`message!`](crate::message) derives one (`module_path!()::Counter`) unless the `impl Actor` sets `NAME`.
#[macro_export]
macro_rules! register_actor {
    ($actor:ty $(, calls: [$($m:ty),* $(,)?])? $(, streams: [$($s:ty),* $(,)?])? $(,)?) => {
        $crate::actor_dispatch!($actor $(, calls: [$($m),*])? $(, streams: [$($s),*])?);
        $crate::inventory::submit! { $crate::ActorFactory::of::<$actor>() }
    };
}
