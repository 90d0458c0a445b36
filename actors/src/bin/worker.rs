//! `ferl-actors-worker`: a binary that only hosts the standard actors (trainer ranks, data loader, checkpointer,
//! metrics, the RL roles) as a worker process. Drivers whose own binary cannot be re-run as a worker (test
//! harnesses) point their cluster at it (`HeadOptions::worker_binary`).

fn main() {
    ferl_trainer::huge_pages::prefer_huge_pages();
    ferl_actors::ensure_linked();
    ferl_runtime::enter_worker_mode_if_spawned();
    eprintln!("ferl-actors-worker hosts actors for a ferl cluster; it is started by node agents, not by hand");
    std::process::exit(2);
}
