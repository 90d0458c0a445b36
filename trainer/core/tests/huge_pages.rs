//! `prefer_huge_pages` reaches libtorch: in a process that calls it before its first tensor (this test binary holds
//! only this test), the memory of a large CPU tensor is marked for huge pages (`hg` among its mapping's `VmFlags` in
//! `/proc/self/smaps`, what `madvise(MADV_HUGEPAGE)` sets); without the variable it is not.

use ferl_trainer::huge_pages::{prefer_huge_pages, THP_ENV};
use tch::{Kind, Tensor};

/// The `VmFlags` of the mapping of this process that holds `address`.
fn vm_flags_at(address: usize) -> Vec<String> {
    let smaps = std::fs::read_to_string("/proc/self/smaps").expect("reading /proc/self/smaps");
    let mut inside = false;
    for line in smaps.lines() {
        let mut fields = line.split_whitespace();
        let first = fields.next().unwrap_or_default();
        if let Some((start, end)) = first.split_once('-') {
            if let (Ok(start), Ok(end)) = (
                usize::from_str_radix(start, 16),
                usize::from_str_radix(end, 16),
            ) {
                inside = (start..end).contains(&address);
                continue;
            }
        }
        if inside && first == "VmFlags:" {
            return fields.map(String::from).collect();
        }
    }
    panic!("no mapping holds {address:#x}");
}

#[test]
fn large_cpu_tensors_are_advised_into_huge_pages() {
    let user_choice = std::env::var(THP_ENV).ok();
    prefer_huge_pages();
    let expected = user_choice.clone().unwrap_or_else(|| "1".into());
    assert_eq!(
        std::env::var(THP_ENV).ok(),
        Some(expected.clone()),
        "a value the user set is kept"
    );
    let t = Tensor::empty([64 << 18], (Kind::Float, tch::Device::Cpu)); // 64 MiB
    let flags = vm_flags_at(t.data_ptr() as usize);
    // A kernel built without transparent huge pages (no /sys/kernel/mm/transparent_hugepage) refuses the advice
    // (madvise says EINVAL), so no mapping is marked there: the flag depends on the machine's kernel, and the test
    // expects it only where the kernel has the feature (any mode, `never` included, records the advice).
    let kernel_has_thp = std::path::Path::new("/sys/kernel/mm/transparent_hugepage").exists();
    if !kernel_has_thp {
        println!("this kernel has no transparent huge pages: no mapping can be marked `hg`");
    }
    assert_eq!(
        flags.iter().any(|f| f == "hg"),
        expected == "1" && kernel_has_thp,
        "VmFlags {flags:?}"
    );
}
