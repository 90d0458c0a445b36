//! libtorch's large CPU tensors in transparent huge pages.
//!
//! A CPU training step allocates and frees large tensors all the time: FULL_SHARD's gathered layers (freed after
//! use by design), logits chunks, gradients, activations. libtorch takes them from the C library, which returns large
//! blocks to the kernel when they are freed, so the next allocation faults in and zeroes fresh 4 KiB pages: a fifth
//! of a FULL_SHARD rank's time in `ferl-bench train --nproc-per-node 2` went to page faults. With
//! `THP_MEM_ALLOC_ENABLE=1` libtorch asks the kernel to back its large allocations with 2 MiB pages
//! (`madvise(MADV_HUGEPAGE)`), up to 512 times fewer faults: tokens/s of that benchmark rose by 18–23 % at world 1
//! and 2 with the same peak memory within 1 %, and the one-process comparison's by 17 % (both sides). Memory is
//! then taken 2 MiB at a time: the sequence-parallel benchmark at 4,096 tokens peaked 2–5 % higher.

/// The libtorch variable ([`prefer_huge_pages`] sets it).
pub const THP_ENV: &str = "THP_MEM_ALLOC_ENABLE";

/// Makes this process's libtorch put large CPU tensors in transparent huge pages, unless
/// [`THP_ENV`] is already set (a user's `0` keeps them off). libtorch reads the variable once, at the process's first
/// allocation, and child processes inherit it: call this first thing in `main`, while the process has one thread, as
/// `ferl::enter_worker_mode_if_spawned` does. Without transparent huge pages in the kernel (`never`) the advice is
/// ignored and nothing changes.
pub fn prefer_huge_pages() {
    if std::env::var_os(THP_ENV).is_none() {
        std::env::set_var(THP_ENV, "1");
    }
}
