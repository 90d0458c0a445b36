//! Kernel plugins on tch tensors.
//!
//! - [`host_ops`]: the [`ferl_plugin_abi::kernel::HostOps`] table implemented with libtorch, so a kernel plugin's
//!   algorithm runs on CPU or CUDA tensors at libtorch speed;
//! - [`Kernels`] ([`kernels`]): the `liger` ops (built in from `ferl-kernels`, or from a loaded plugin version) as
//!   ordinary tensor functions, with autograd where the op allows it;
//! - [`reference`]: the plain-tch definitions the kernels must match (tests, benchmarks, `use_liger=false`).

pub mod host_ops;
pub mod kernels;
pub mod reference;

pub use kernels::{Kernels, Reduction, RmsNormSaved};
pub use tch;
