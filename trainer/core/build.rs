//! Compiles `csrc/varlen_attention.cpp` (torch's variable-length attention kernels, which tch does not expose),
//! `csrc/packed_attention.cpp` (packed attention on the CPU as one autograd op),
//! `csrc/storage.cpp` (freeing and refilling a tensor's storage in place, for FULL_SHARD), `csrc/vjp.cpp` (a
//! vector-Jacobian product with output gradients) and `csrc/skinny_gemm.cpp` (`W·xᵀ` for a decode step's few rows) against the libtorch headers of the libtorch torch-sys links (its
//! `links = "tch"` metadata names the folder).

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=csrc/varlen_attention.cpp");
    println!("cargo:rerun-if-changed=csrc/storage.cpp");
    println!("cargo:rerun-if-changed=csrc/packed_attention.cpp");
    println!("cargo:rerun-if-changed=csrc/skinny_gemm.cpp");
    println!("cargo:rerun-if-changed=csrc/skinny_tiles.inc");
    println!("cargo:rerun-if-changed=csrc/vjp.cpp");
    println!("cargo:rerun-if-env-changed=LIBTORCH_CXX11_ABI");
    let lib = std::env::var("DEP_TCH_LIBTORCH_LIB")
        .expect("torch-sys did not export the libtorch folder (DEP_TCH_LIBTORCH_LIB)");
    let include = std::path::Path::new(&lib).join("../include");
    let abi = std::env::var("LIBTORCH_CXX11_ABI").unwrap_or_else(|_| "1".into());
    let build = || {
        let mut b = cc::Build::new();
        b.cpp(true)
            .pic(true)
            .warnings(false)
            .include(&include)
            .flag("-std=c++17")
            .flag(format!("-D_GLIBCXX_USE_CXX11_ABI={abi}"));
        b
    };
    build()
        .file("csrc/varlen_attention.cpp")
        .file("csrc/storage.cpp")
        .file("csrc/packed_attention.cpp")
        .file("csrc/vjp.cpp")
        .compile("ferl_varlen_attention");
    // `at::parallel_for` is inline OpenMP in libtorch's CPU builds: compiled with `-fopenmp` it runs on the OpenMP pool
    // torch's ops use (libgomp.so.1, loaded once by its soname for libtorch and this code alike).
    build()
        .flag("-fopenmp")
        .file("csrc/skinny_gemm.cpp")
        .compile("ferl_skinny_gemm");
    println!("cargo:rustc-link-lib=gomp");
}
