//! Kernel plugin `liger`: exports `ferl-kernels`' table (fused linear + cross-entropy, RMSNorm, SwiGLU) so a job can
//! load, or hot-replace, the kernels from a file instead of the copy built into ferl.

ferl_plugin_abi::export_kernel!(ferl_kernels::Liger, table = ferl_kernels::LIGER_TABLE);
