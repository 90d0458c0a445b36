//! The pool of large aligned buffers that encoding writes into and received messages are read into: writing into
//! memory the process already touched costs no page faults, which on a virtual machine cost more than the copy
//! itself. Buffers of [`LARGE`] bytes or more are recycled; smaller ones are simply freed.

use std::sync::Mutex;

use rkyv::util::AlignedVec;

/// Buffers at least this large are pooled, and received messages this large share their buffer with the
/// [`SharedBytes`](crate::SharedBytes) fields decoded from them (the transport's same-host threshold is the same).
pub const LARGE: usize = 64 << 10;
/// Buffers at least this large ask the kernel for huge pages (fewer page faults when they are first written).
const HUGE_ADVICE_MIN: usize = 4 << 20;

/// An aligned buffer with room for `len` bytes; large ones are advised to use transparent huge pages.
pub fn aligned_buffer(len: usize) -> AlignedVec {
    let mut v = AlignedVec::<16>::with_capacity(len);
    if len >= HUGE_ADVICE_MIN {
        const HUGE: usize = 2 << 20;
        let start = (v.as_mut_ptr() as usize).next_multiple_of(HUGE);
        let end = (v.as_mut_ptr() as usize + len) / HUGE * HUGE;
        if end > start {
            // SAFETY: advice on whole pages inside this allocation; it changes no contents.
            unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE) };
        }
    }
    v
}

/// Large buffers kept for reuse: writing into memory the process already touched costs no page faults, which on a
/// virtual machine cost more than the copy itself. At most `SPARE_COUNT` buffers, `SPARE_BYTES` in all.
static SPARES: Mutex<Vec<AlignedVec>> = Mutex::new(Vec::new());
const SPARE_COUNT: usize = 4;
const SPARE_BYTES: usize = 512 << 20;

/// An empty aligned buffer with room for `len` bytes: a recycled one when one fits, else a new one.
pub fn buffer(len: usize) -> AlignedVec {
    if len >= LARGE {
        let mut spares = SPARES.lock().expect("spare buffers lock");
        let best = spares
            .iter()
            .enumerate()
            .filter(|(_, b)| b.capacity() >= len)
            .min_by_key(|(_, b)| b.capacity())
            .map(|(i, _)| i);
        if let Some(i) = best {
            return spares.swap_remove(i);
        }
    }
    aligned_buffer(len)
}

/// Keeps a large buffer for [`buffer`] to hand out again (small ones, and any beyond the limits, are freed).
pub fn recycle(mut buf: AlignedVec) {
    if buf.capacity() < LARGE {
        return;
    }
    buf.clear();
    let mut spares = SPARES.lock().expect("spare buffers lock");
    let held: usize = spares.iter().map(|b| b.capacity()).sum();
    if spares.len() < SPARE_COUNT && held + buf.capacity() <= SPARE_BYTES {
        spares.push(buf);
    }
}
