//! Groups whose ranks are threads of this process (loopback TCP, in-memory rendezvous): protocol checks, fine
//! pipelining, flat shards against unsharded math, and the NCCL backend (run on a GPU, skipped with a reason here).

use ferl_collective::flat::{FlatLayout, FlatShard};
use ferl_collective::{
    connect, nccl_available, Communicator, GroupOptions, MemoryRendezvous, ReduceOp, Rendezvous,
    TcpCommunicator, Transport,
};
use std::sync::Arc;
use std::time::Duration;
use tch::{Device, Kind, Tensor};

/// Runs `body(comm)` on `world` threads, each a rank of one TCP group; returns the results in rank order.
fn with_group<T: Send + 'static>(
    world: usize,
    options: GroupOptions,
    body: impl Fn(TcpCommunicator) -> T + Send + Sync + 'static,
) -> Vec<T> {
    with_group_per_rank(world, move |_| options.clone(), body)
}

/// [`with_group`] with each rank's options from `options_of(rank)`.
fn with_group_per_rank<T: Send + 'static>(
    world: usize,
    options_of: impl Fn(usize) -> GroupOptions,
    body: impl Fn(TcpCommunicator) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let store: Arc<dyn Rendezvous> = Arc::new(MemoryRendezvous::new());
    let body = Arc::new(body);
    let threads: Vec<_> = (0..world)
        .map(|rank| {
            let (store, body, options) = (store.clone(), body.clone(), options_of(rank));
            std::thread::spawn(move || {
                body(TcpCommunicator::connect(rank, world, store, &options).unwrap())
            })
        })
        .collect();
    threads.into_iter().map(|t| t.join().unwrap()).collect()
}

fn quick_options() -> GroupOptions {
    GroupOptions {
        timeout: Duration::from_secs(60),
        ..GroupOptions::default()
    }
}

#[test]
fn mismatched_collectives_fail_on_every_rank_and_poison_the_group() {
    let results = with_group(2, quick_options(), |comm| {
        let mut t = Tensor::ones([10 + comm.rank() as i64], (Kind::Float, Device::Cpu));
        let first = comm
            .all_reduce(&mut t, ReduceOp::Sum)
            .map_err(|e| e.to_string());
        let second = comm.barrier().map_err(|e| e.to_string());
        (first, second)
    });
    for (rank, (first, second)) in results.into_iter().enumerate() {
        let first = first.expect_err("sizes differ, the collective must fail");
        assert!(
            first.contains(&format!("rank {rank}")) && first.contains("all_reduce"),
            "{first}"
        );
        assert!(
            second.unwrap_err().contains("failed earlier"),
            "rank {rank}: later calls must fail too"
        );
    }
}

#[test]
fn small_chunks_pipeline_every_ring_step() {
    let options = GroupOptions {
        chunk_bytes: 4096,
        ..quick_options()
    };
    let results = with_group(3, options, |comm| {
        let n = 50_001i64;
        let mine = Tensor::arange(n, (Kind::Float, Device::Cpu)) * (comm.rank() as f64 + 1.0);
        let mut sum = mine.copy();
        comm.all_reduce(&mut sum, ReduceOp::Sum).unwrap();
        let gathered = comm.all_gather_flat(&mine).unwrap();
        let input = Tensor::arange(3 * n, (Kind::Float, Device::Cpu)) + comm.rank() as f64;
        let shard = comm.reduce_scatter_flat(&input, ReduceOp::Avg).unwrap();
        (comm.rank(), sum, gathered, shard)
    });
    let base = Tensor::arange(50_001, (Kind::Float, Device::Cpu));
    for (rank, sum, gathered, shard) in results {
        assert!(sum.equal(&(&base * 6.0)), "all_reduce on rank {rank}");
        let expected: Vec<Tensor> = (1..=3).map(|k| &base * k as f64).collect();
        assert!(
            gathered.equal(&Tensor::cat(&expected, 0)),
            "all_gather on rank {rank}"
        );
        let full_avg = Tensor::arange(3 * 50_001, (Kind::Float, Device::Cpu)) + 1.0;
        assert!(shard.allclose(
            &full_avg.narrow(0, rank as i64 * 50_001, 50_001),
            1e-6,
            1e-6,
            false
        ));
    }
}

#[test]
fn same_host_pairs_use_shared_memory_unless_a_rank_opts_out_and_mixed_rings_still_agree() {
    // Rank 1 refuses shared memory: its pairs keep TCP, the pair (0, 2) uses shared memory, and the ring mixes both.
    let options_of = |rank: usize| GroupOptions {
        chunk_bytes: 8192,
        shared_memory: rank != 1,
        ..quick_options()
    };
    let n = 300_007i64;
    let results = with_group_per_rank(3, options_of, move |comm| {
        let transports: Vec<Option<Transport>> = (0..4).map(|p| comm.transport(p)).collect();
        let mine = Tensor::arange(n, (Kind::Float, Device::Cpu)) * (comm.rank() as f64 + 1.0);
        let mut sum = mine.copy();
        comm.all_reduce(&mut sum, ReduceOp::Sum).unwrap();
        let gathered = comm.all_gather_flat(&mine).unwrap();
        let shard = comm.reduce_scatter_flat(&gathered, ReduceOp::Sum).unwrap();
        let mut small = Tensor::from_slice(&[comm.rank() as i64, 1]);
        comm.all_reduce(&mut small, ReduceOp::Max).unwrap();
        (comm.rank(), transports, sum, gathered, shard, small)
    });
    let base = Tensor::arange(n, (Kind::Float, Device::Cpu));
    let uses_shm = |a: usize, b: usize| a != 1 && b != 1;
    for (rank, transports, sum, gathered, shard, small) in results {
        for (peer, t) in transports.iter().enumerate() {
            let expected = match peer {
                p if p == rank || p >= 3 => None,
                p if uses_shm(rank, p) => Some(Transport::SharedMemory),
                _ => Some(Transport::Tcp),
            };
            assert_eq!(*t, expected, "rank {rank} to rank {peer}");
        }
        assert!(sum.equal(&(&base * 6.0)), "all_reduce on rank {rank}");
        let parts: Vec<Tensor> = (1..=3).map(|k| &base * k as f64).collect();
        assert!(
            gathered.equal(&Tensor::cat(&parts, 0)),
            "all_gather on rank {rank}"
        );
        assert!(
            shard.equal(&(&parts[rank] * 3.0)),
            "reduce_scatter on rank {rank}"
        );
        assert_eq!(Vec::<i64>::try_from(&small).unwrap(), vec![2, 1]);
    }
    // With the defaults every pair of a same-host group talks through shared memory.
    let defaults = with_group(2, quick_options(), |comm| comm.transport(1 - comm.rank()));
    assert_eq!(defaults, vec![Some(Transport::SharedMemory); 2]);
}

#[test]
fn tensors_the_backend_cannot_use_are_rejected_with_a_reason() {
    let results = with_group(2, quick_options(), |comm| {
        let mut strided = Tensor::ones([4, 3], (Kind::Float, Device::Cpu)).transpose(0, 1);
        let not_contiguous = comm
            .all_reduce(&mut strided, ReduceOp::Sum)
            .unwrap_err()
            .to_string();
        let mut ints = Tensor::ones([4], (Kind::Int, Device::Cpu));
        let avg_ints = comm
            .all_reduce(&mut ints, ReduceOp::Avg)
            .unwrap_err()
            .to_string();
        let mut wrong = Tensor::ones([3], (Kind::Float, Device::Cpu));
        let bad_output = comm
            .all_gather(&mut wrong, &Tensor::ones([2], (Kind::Float, Device::Cpu)))
            .unwrap_err()
            .to_string();
        // Rejections happen before any byte is sent, so the group still works.
        let mut t = Tensor::ones([5], (Kind::Float, Device::Cpu));
        comm.all_reduce(&mut t, ReduceOp::Sum).unwrap();
        (not_contiguous, avg_ints, bad_output, t)
    });
    for (not_contiguous, avg_ints, bad_output, t) in results {
        assert!(
            not_contiguous.contains("not contiguous"),
            "{not_contiguous}"
        );
        assert!(avg_ints.contains("Avg"), "{avg_ints}");
        assert!(bad_output.contains("expected 4"), "{bad_output}");
        assert!(t.equal(&Tensor::full([5], 2.0, (Kind::Float, Device::Cpu))));
    }
}

/// A toy layer: parameters of odd sizes, and a per-rank gradient that differs between ranks. The values come from a
/// formula, not torch's global RNG: every rank thread builds them, and concurrent `manual_seed` + `randn` calls from
/// several threads would interleave and give the ranks different "identical" parameters.
fn layer_params() -> Vec<Tensor> {
    let values = |shape: &[i64], offset: f64| {
        let n: i64 = shape.iter().product();
        (Tensor::arange(n, (Kind::Float, Device::Cpu)) * 0.37 + offset)
            .sin()
            .reshape(shape)
    };
    vec![
        values(&[3, 5], 0.1),
        values(&[7], 1.3),
        values(&[2, 2], 2.7),
    ]
}

fn rank_grads(params: &[Tensor], rank: usize) -> Vec<Tensor> {
    params
        .iter()
        .map(|p| p.sin() * (rank as f64 + 1.0) + 0.5)
        .collect()
}

#[test]
fn flat_shard_sgd_step_matches_unsharded_math_for_world_1_2_4() {
    for world in [1usize, 2, 4] {
        let lr = 0.1;
        // Unsharded: the mean of every rank's gradient, one SGD step on the full parameters.
        let params = layer_params();
        let expected: Vec<Tensor> = params
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let mean = (0..world)
                    .map(|r| rank_grads(&params, r)[i].shallow_clone())
                    .fold(p.zeros_like(), |a, g| a + g)
                    / world as f64;
                p - mean * lr
            })
            .collect();
        let results = with_group(world, quick_options(), move |comm| {
            let params = layer_params();
            let mut shard = FlatShard::from_full(&params, comm.rank(), world, Kind::Float).unwrap();
            shard
                .reduce_scatter_grads(&comm, &rank_grads(&params, comm.rank()), ReduceOp::Avg)
                .unwrap();
            let step = shard.grad.as_ref().unwrap() * lr;
            shard.params -= step;
            let (_flat, views) = shard.gather(&comm, Kind::Float).unwrap();
            views
        });
        for (rank, views) in results.into_iter().enumerate() {
            for (i, (got, want)) in views.iter().zip(&expected).enumerate() {
                assert!(
                    got.allclose(want, 1e-6, 1e-6, false),
                    "world {world} rank {rank} tensor {i}"
                );
            }
        }
        assert_eq!(FlatLayout::of(&layer_params(), world).total(), 26);
    }
}

#[test]
fn nccl_backend_matches_reference_on_one_gpu_or_skips() {
    if let Err(why) = nccl_available() {
        println!("SKIP nccl_backend_matches_reference_on_one_gpu_or_skips: {why:#}");
        let store: Arc<dyn Rendezvous> = Arc::new(MemoryRendezvous::new());
        let err = connect(Device::Cuda(0), 0, 1, store, &quick_options())
            .err()
            .expect("NCCL must not start here");
        assert!(format!("{err:#}").contains("NCCL"), "{err:#}");
        return;
    }
    let store: Arc<dyn Rendezvous> = Arc::new(MemoryRendezvous::new());
    let comm = connect(Device::Cuda(0), 0, 1, store, &quick_options()).unwrap();
    let dev = Device::Cuda(0);
    for kind in [Kind::Float, Kind::BFloat16] {
        let x = Tensor::arange(1001, (Kind::Float, dev)).to_kind(kind);
        let mut y = x.copy();
        comm.all_reduce(&mut y, ReduceOp::Sum).unwrap();
        assert!(y.equal(&x), "all_reduce {kind:?}");
        let g = comm.all_gather_flat(&x).unwrap();
        assert!(g.equal(&x), "all_gather {kind:?}");
        let s = comm.reduce_scatter_flat(&x, ReduceOp::Sum).unwrap();
        assert!(s.equal(&x), "reduce_scatter {kind:?}");
        let mut b = x.copy();
        comm.broadcast(&mut b, 0).unwrap();
        let mut a = x.zeros_like();
        comm.all_to_all(&mut a, &x).unwrap();
        assert!(b.equal(&x) && a.equal(&x), "broadcast/all_to_all {kind:?}");
    }
    comm.barrier().unwrap();
    println!("NCCL OK on {:?}", dev);
}
