//! An actor runtime tour: embedded cluster, a typed actor with call / tell / stream, a resource group with a
//! worker group (broadcast, one message per rank, split-and-gather, rank 0), a call with a deadline, an object put
//! once and read by every rank (and one filled in shared memory, which same-host ranks map), and the head's key-value
//! store.
//! Run: `cargo run -p ferl-examples --example actors`
use ferl::runtime::ObjectRef;
use ferl::{bundle, Actor, Context, Handler, SpawnOptions, Strategy, WorkerGroup};
use rkyv::{Archive, Deserialize, Serialize};
use std::sync::Mutex;
use std::time::Duration;

/// Keeps a list of numbers.
struct Summer(Mutex<Vec<u64>>);
/// Append numbers; replies with the running sum.
#[derive(Archive, Serialize, Deserialize, Clone)]
struct Push(Vec<u64>);
/// Which rank am I?
#[derive(Archive, Serialize, Deserialize, Clone)]
struct Rank;
/// Sum the bytes of an object.
#[derive(Archive, Serialize, Deserialize, Clone)]
struct SumBytes(ObjectRef);
ferl::message!(Push => u64; Rank => String; SumBytes => u64);

impl Actor for Summer {
    type Args = ();
    async fn start(_: (), _: &Context) -> anyhow::Result<Self> {
        Ok(Summer(Mutex::new(Vec::new())))
    }
}
impl Handler<Push> for Summer {
    async fn handle(&self, m: Push, _: &Context) -> anyhow::Result<u64> {
        let mut v = self.0.lock().unwrap();
        v.extend(m.0);
        Ok(v.iter().sum())
    }
}
impl Handler<Rank> for Summer {
    async fn handle(&self, _: Rank, _: &Context) -> anyhow::Result<String> {
        Ok(std::env::var("RANK").unwrap_or_default())
    }
}
impl Handler<SumBytes> for Summer {
    async fn handle(&self, m: SumBytes, ctx: &Context) -> anyhow::Result<u64> {
        let bytes = ctx.cluster().get(&m.0).await?; // fetched once per node, or mapped on the owner's host
        Ok(bytes.iter().map(|b| *b as u64).sum())
    }
}
// Registered as `actors::Summer` (the name is derived as `message!` derives one).
ferl::register_actor!(Summer, calls: [Push, Rank, SumBytes]);

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    ferl::enter_worker_mode_if_spawned(); // workers are this binary, re-run in worker mode
    let cluster = ferl::init(Default::default()).await?;
    let one = cluster.spawn::<Summer>((), SpawnOptions::new()).await?;
    one.tell(Push(vec![1, 2])).await?;
    println!("sum = {}", one.call(Push(vec![3])).await?);

    let group = cluster
        .create_group(
            vec![bundle(&[("CPU", 1.0)]); 2],
            Strategy::Spread,
            Duration::from_secs(10),
        )
        .await?;
    let workers =
        WorkerGroup::<Summer>::spawn(&cluster, &group, |_| (), SpawnOptions::new()).await?;
    println!("ranks = {:?}", workers.call_all(Rank).await?);
    println!(
        "split sums = {:?}",
        workers
            .call_split((1..=10).collect(), |_, chunk| Push(chunk))
            .await?
    );
    println!("rank 0 = {}", workers.call_rank0(Push(vec![])).await?);
    let each = workers.call_each(vec![Push(vec![100]), Push(vec![200])]);
    println!("each = {:?}", each.await?);
    let late = workers
        .rank(1)
        .call(Push(vec![]))
        .timeout(Duration::from_secs(5));
    println!("rank 1 within 5 s = {}", late.await?);
    let batch = cluster.put(vec![1u8; 1 << 20])?; // freed when `batch` (and its clones here) drop
    let sums = workers.call_all(SumBytes(batch.clone())).await?;
    println!("object sums = {sums:?}");
    // Filled in place in shared memory: workers on this host map it instead of receiving a copy.
    let mut buffer = cluster.object_buffer(1 << 20);
    buffer.fill(2);
    let shared = cluster.put_buffer(buffer)?;
    let sums = workers.call_all(SumBytes(shared.clone())).await?;
    println!("shared-memory object sums = {sums:?}");

    cluster
        .kv_put("rendezvous", b"127.0.0.1:29500".to_vec())
        .await?;
    println!(
        "kv = {:?}",
        String::from_utf8(
            cluster
                .kv_wait("rendezvous", Duration::from_secs(1))
                .await?
        )?
    );
    cluster.remove_group(&group).await?;
    cluster.shutdown().await;
    Ok(())
}
