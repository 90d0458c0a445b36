//! An actor runtime tour: embedded cluster, a typed actor with call / tell / stream, a resource group with a
//! worker group (broadcast, split-and-gather, rank 0), and the head's key-value store.
//! Run: `cargo run -p ferl-examples --example actors`
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
ferl::message!(Push => u64; Rank => String);

impl Actor for Summer {
    type Args = ();
    const NAME: &'static str = "examples.Summer";
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
ferl::register_actor!(Summer, calls: [Push, Rank]);

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
