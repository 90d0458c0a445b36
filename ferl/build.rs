//! Embeds libtorch's folder as an rpath so the binary (and the worker processes that re-run it) starts without
//! `LD_LIBRARY_PATH`. torch-sys exports the folder through its `links = "tch"` metadata.

fn main() {
    if let Ok(dir) = std::env::var("DEP_TCH_LIBTORCH_LIB") {
        println!("cargo:rustc-link-arg-bins=-Wl,-rpath,{dir}");
    }
    println!("cargo:rerun-if-changed=build.rs");
}
