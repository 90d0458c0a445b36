//! Worker groups: verl's single-controller pattern, typed. One actor per bundle of a resource group (rank = bundle
//! index); the driver broadcasts a call, splits a batch across ranks and gathers replies in rank order, or calls
//! rank 0 only.

use futures::future::{join_all, try_join_all};

use crate::actor::actor_ref::ActorRef;
use crate::actor::{Actor, Handler, Message};
use crate::cluster::{Cluster, ResourceGroup, SpawnOptions};
use crate::transport::error::{Error, Result};

/// N actors of type `A`, one per bundle, in rank order.
pub struct WorkerGroup<A> {
    members: Vec<ActorRef<A>>,
}

impl<A> Clone for WorkerGroup<A> {
    fn clone(&self) -> Self {
        Self {
            members: self.members.clone(),
        }
    }
}

/// Splits `items` into `parts` contiguous chunks whose sizes differ by at most one (earlier ranks get the extra).
pub fn split_even<T>(items: Vec<T>, parts: usize) -> Vec<Vec<T>> {
    let parts = parts.max(1);
    let (base, extra) = (items.len() / parts, items.len() % parts);
    let mut it = items.into_iter();
    (0..parts)
        .map(|r| it.by_ref().take(base + usize::from(r < extra)).collect())
        .collect()
}

impl<A: Actor> WorkerGroup<A> {
    /// Spawns one actor per bundle of `group`; `args(rank)` builds each constructor's arguments, `opts` applies to
    /// all (its bundle is set per rank).
    pub async fn spawn(
        cluster: &Cluster,
        group: &ResourceGroup,
        args: impl Fn(usize) -> A::Args,
        opts: SpawnOptions,
    ) -> Result<Self> {
        let spawns = (0..group.len())
            .map(|rank| cluster.spawn::<A>(args(rank), opts.clone().in_bundle(group, rank)));
        Ok(Self {
            members: try_join_all(spawns).await?,
        })
    }

    /// Wraps existing actors (rank = position).
    pub fn from_members(members: Vec<ActorRef<A>>) -> Self {
        Self { members }
    }

    /// Number of ranks.
    pub fn len(&self) -> usize {
        self.members.len()
    }

    /// Whether the group is empty.
    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }

    /// The actor of one rank.
    pub fn rank(&self, rank: usize) -> &ActorRef<A> {
        &self.members[rank]
    }

    /// All members in rank order.
    pub fn members(&self) -> &[ActorRef<A>] {
        &self.members
    }

    /// Sends the same message to every rank; replies in rank order.
    pub async fn call_all<M: Message + Clone>(&self, msg: M) -> Result<Vec<M::Reply>>
    where
        A: Handler<M>,
    {
        try_join_all(self.members.iter().map(|m| m.call(msg.clone()))).await
    }

    /// Sends message `i` to rank `i`, all at once (ranks that meet in collectives need each other), and gathers the
    /// replies in rank order. Every call runs to its end; when some fail, the error is [`Error::Rank`] naming the
    /// rank, its actor and node, and a rank whose actor died is preferred over the others, whose failures (a
    /// collective that lost its peer) are its consequence. Fails at once, sending nothing, unless there is exactly
    /// one message per rank.
    pub async fn call_each<M: Message>(&self, messages: Vec<M>) -> Result<Vec<M::Reply>>
    where
        A: Handler<M>,
    {
        if messages.len() != self.members.len() {
            return Err(Error::Cluster(format!(
                "call_each got {} messages of {} for a group of {} ranks",
                messages.len(),
                M::NAME,
                self.members.len()
            )));
        }
        let calls = self
            .members
            .iter()
            .zip(messages)
            .map(|(m, msg)| m.call(msg));
        gather(&self.members, join_all(calls).await)
    }

    /// Splits `items` evenly by rank, builds one message per chunk, and gathers replies in rank order.
    pub async fn call_split<T, M: Message>(
        &self,
        items: Vec<T>,
        make: impl Fn(usize, Vec<T>) -> M,
    ) -> Result<Vec<M::Reply>>
    where
        A: Handler<M>,
    {
        let chunks = split_even(items, self.members.len());
        try_join_all(
            self.members
                .iter()
                .zip(chunks)
                .enumerate()
                .map(|(rank, (m, chunk))| m.call(make(rank, chunk))),
        )
        .await
    }

    /// Sends a message to rank 0 only.
    pub async fn call_rank0<M: Message>(&self, msg: M) -> Result<M::Reply>
    where
        A: Handler<M>,
    {
        self.members[0].call(msg).await
    }
}

/// Replies in rank order, or the error of the first rank whose actor died, else of the first rank that failed.
fn gather<A: Actor, R>(members: &[ActorRef<A>], replies: Vec<Result<R>>) -> Result<Vec<R>> {
    let failed = replies
        .iter()
        .position(|r| r.as_ref().is_err_and(Error::is_actor_death))
        .or_else(|| replies.iter().position(Result::is_err));
    let Some(rank) = failed else {
        return replies.into_iter().collect();
    };
    let cause = replies
        .into_iter()
        .nth(rank)
        .and_then(Result::err)
        .expect("an error");
    Err(Error::Rank {
        rank,
        actor: members[rank].name(),
        node: members[rank].node(),
        cause: Box::new(cause),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guarantee_9_split_is_even_contiguous_and_ordered() {
        let parts = split_even((0..10).collect::<Vec<_>>(), 3);
        assert_eq!(parts, vec![vec![0, 1, 2, 3], vec![4, 5, 6], vec![7, 8, 9]]);
        assert_eq!(split_even(vec![1], 3), vec![vec![1], vec![], vec![]]);
    }
}
