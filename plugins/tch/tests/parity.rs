//! The `liger` kernels equal the reference ops within 1e-5 (fp32), forward and backward, both built in and loaded
//! from the `ferl-plugin-liger` library file. "Within 1e-5" is `allclose(atol = 1e-5, rtol = 1e-5)`: a summed loss of
//! ~300 has an fp32 spacing of 3e-5, so a purely absolute bound would test rounding, not the kernel.

use ferl_plugin_host::cargo_build::{build_plugin, workspace_root, PluginBuild};
use ferl_plugin_host::{PluginHost, PluginKind};
use ferl_plugin_tch::{reference, Kernels, Reduction};
use std::path::Path;
use tch::{Device, Kind, Tensor};

const TOL: f64 = 1e-5;

/// The largest `|a - b| - TOL * |b|` (at most `TOL` when `a` and `b` are allclose with atol = rtol = `TOL`).
fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    assert_eq!(a.size(), b.size());
    ((a - b).abs() - b.abs() * TOL).max().double_value(&[])
}

thread_local! {
    /// The device the checks of this thread run on.
    static DEVICE: std::cell::Cell<Device> = const { std::cell::Cell::new(Device::Cpu) };
}

fn device() -> Device {
    DEVICE.with(|d| d.get())
}

fn randn(shape: &[i64], scale: f64) -> Tensor {
    Tensor::randn(shape, (Kind::Float, device())) * scale
}

/// Reference and kernel loss, d hidden and d weight for one configuration.
fn check_fused_ce(
    k: &Kernels,
    n: i64,
    h: i64,
    v: i64,
    chunk: usize,
    reduction: Reduction,
    ignored: &[i64],
) {
    let hidden = randn(&[n, h], 1.0).set_requires_grad(true);
    let weight = randn(&[v, h], 0.5).set_requires_grad(true);
    let targets = Tensor::randint(v, [n], (Kind::Int64, device()));
    for &i in ignored {
        let _ = targets.get(i).fill_(-100);
    }
    let r = reference::linear_cross_entropy(&hidden, &weight, &targets, -100, reduction);
    let (rh, rw) = {
        let g = Tensor::run_backward(&[&(&r * 1.5)], &[&hidden, &weight], false, false);
        (g[0].shallow_clone(), g[1].shallow_clone())
    };
    let f = k
        .fused_linear_cross_entropy(&hidden, &weight, &targets, -100, reduction, chunk)
        .unwrap();
    let g = Tensor::run_backward(&[&(&f * 1.5)], &[&hidden, &weight], false, false);
    let what = format!("n={n} h={h} v={v} chunk={chunk} {reduction:?} ignored={ignored:?}");
    assert!(
        max_diff(&r, &f) <= TOL,
        "loss {what}: {} vs {}",
        r.double_value(&[]),
        f.double_value(&[])
    );
    assert!(
        max_diff(&rh, &g[0]) <= TOL,
        "d hidden {what}: {}",
        max_diff(&rh, &g[0])
    );
    assert!(
        max_diff(&rw, &g[1]) <= TOL,
        "d weight {what}: {}",
        max_diff(&rw, &g[1])
    );
}

fn check_all(k: &Kernels) {
    tch::manual_seed(7);
    check_fused_ce(k, 37, 16, 1000, 8, Reduction::Mean, &[0, 5, 36]); // chunks that do not divide N
    check_fused_ce(k, 37, 16, 1000, 0, Reduction::Sum, &[3]);
    check_fused_ce(k, 64, 32, 5003, 64, Reduction::Mean, &[]);

    let x = randn(&[3, 5, 24], 2.0).set_requires_grad(true);
    let w = (randn(&[24], 0.1) + 1.0).set_requires_grad(true);
    let dy = randn(&[3, 5, 24], 1.0);
    let r = reference::rms_norm(&x, &w, 1e-6);
    let rg = Tensor::run_backward(&[&(&r * &dy).sum(None::<Kind>)], &[&x, &w], false, false);
    let (y, saved) = k.rms_norm_forward(&x, &w, 1e-6).unwrap();
    let (dx, dw) = k.rms_norm_backward(&dy, &x, &w, &saved).unwrap();
    assert!(
        max_diff(&r, &y) <= TOL,
        "rms_norm forward {}",
        max_diff(&r, &y)
    );
    assert!(
        max_diff(&rg[0], &dx) <= TOL,
        "rms_norm dx {}",
        max_diff(&rg[0], &dx)
    );
    assert!(
        max_diff(&rg[1], &dw) <= TOL,
        "rms_norm dweight {}",
        max_diff(&rg[1], &dw)
    );

    let gate = randn(&[4, 7, 40], 3.0).set_requires_grad(true);
    let up = randn(&[4, 7, 40], 1.0).set_requires_grad(true);
    let dy = randn(&[4, 7, 40], 1.0);
    let r = reference::swiglu(&gate, &up);
    let rg = Tensor::run_backward(
        &[&(&r * &dy).sum(None::<Kind>)],
        &[&gate, &up],
        false,
        false,
    );
    let (dg, du) = k.swiglu_backward(&dy, &gate, &up).unwrap();
    assert!(
        max_diff(&rg[0], &dg) <= TOL,
        "swiglu dgate {}",
        max_diff(&rg[0], &dg)
    );
    assert!(
        max_diff(&rg[1], &du) <= TOL,
        "swiglu dup {}",
        max_diff(&rg[1], &du)
    );
    // Through autograd as well.
    let y = k.swiglu(&gate, &up).unwrap();
    assert!(
        max_diff(&r, &y) <= TOL,
        "swiglu forward {}",
        max_diff(&r, &y)
    );
    let ag = Tensor::run_backward(
        &[&(&y * &dy).sum(None::<Kind>)],
        &[&gate, &up],
        false,
        false,
    );
    assert!(
        max_diff(&rg[0], &ag[0]) <= TOL && max_diff(&rg[1], &ag[1]) <= TOL,
        "swiglu autograd"
    );
}

#[test]
fn builtin_kernels_match_reference_within_1e_5() {
    check_all(&Kernels::builtin().unwrap());
}

#[test]
fn cuda_kernels_match_reference_within_1e_5() {
    // libtorch_cuda is loaded at run time: the linker drops it from binaries that never name its symbols.
    if ferl_collective::load_torch_cuda().is_err() || !tch::Cuda::is_available() {
        eprintln!("skipped: no CUDA device (the same kernels run on CUDA tensors through the tch HostOps)");
        return;
    }
    // libtorch keeps TF32 matmuls off by default, so CUDA fp32 is held to the same 1e-5.
    DEVICE.with(|d| d.set(Device::Cuda(0)));
    check_all(&Kernels::builtin().unwrap());
}

#[test]
fn liger_plugin_file_matches_reference_within_1e_5() {
    let ws = workspace_root(Path::new(env!("CARGO_MANIFEST_DIR"))).unwrap();
    let target = std::env::temp_dir()
        .join("ferl-plugin-builds")
        .join("ferl-plugin-liger");
    let spec = PluginBuild {
        package: "ferl-plugin-liger".into(),
        ..Default::default()
    };
    let file = build_plugin(&ws, &target, &spec).unwrap_or_else(|e| panic!("{e:#}"));
    let dir = tempfile::tempdir().unwrap();
    let host = PluginHost::new(dir.path());
    host.load_file(&file, Some(PluginKind::Kernel)).unwrap();
    let k = Kernels::from_host(&host, "liger").unwrap();
    assert_eq!(
        k.plugin().info().file,
        file,
        "served by the loaded file, not the built-in copy"
    );
    check_all(&k);
}

#[test]
fn kernel_errors_name_the_plugin_and_op() {
    let k = Kernels::builtin().unwrap();
    let hidden = randn(&[4, 8], 1.0);
    let weight = randn(&[10, 9], 1.0);
    let targets = Tensor::zeros([4], (Kind::Int64, Device::Cpu));
    let e = k
        .fused_linear_cross_entropy(&hidden, &weight, &targets, -100, Reduction::Mean, 0)
        .unwrap_err();
    let e = format!("{e:#}");
    assert!(
        e.contains("liger@")
            && e.contains("fused_linear_cross_entropy.forward")
            && e.contains("[10, 9]"),
        "{e}"
    );
}

#[test]
fn all_targets_ignored_gives_zero_loss_and_gradients() {
    let k = Kernels::builtin().unwrap();
    let hidden = randn(&[3, 4], 1.0).set_requires_grad(true);
    let weight = randn(&[6, 4], 1.0);
    let targets = Tensor::full([3], -100, (Kind::Int64, Device::Cpu));
    let f = k
        .fused_linear_cross_entropy(&hidden, &weight, &targets, -100, Reduction::Mean, 0)
        .unwrap();
    assert_eq!(f.double_value(&[]), 0.0);
    let g = Tensor::run_backward(&[&f], &[&hidden], false, false);
    assert_eq!(g[0].abs().sum(None::<Kind>).double_value(&[]), 0.0);
}

/// Mixed precision: fp32 rows with a bf16 output matrix. The products run in bf16, the loss and the gradients stay
/// in fp32 (the loss is not rounded to bf16's 8-bit mantissa), within bf16's precision of the fp32 reference on the
/// same (bf16-rounded) values.
#[test]
fn fused_ce_with_fp32_rows_and_bf16_weight_accumulates_in_fp32() {
    tch::manual_seed(3);
    let k = Kernels::builtin().unwrap();
    let hidden = randn(&[45, 32], 1.0);
    let weight = randn(&[3001, 32], 0.5).to_kind(Kind::BFloat16);
    let targets = Tensor::randint(3001, [45], (Kind::Int64, Device::Cpu));
    let (loss, gh, gw) = k
        .fused_linear_cross_entropy_grads(&hidden, &weight, &targets, -100, Reduction::Sum, 16)
        .unwrap();
    assert_eq!(
        (loss.kind(), gh.kind(), gw.kind()),
        (Kind::Float, Kind::Float, Kind::Float)
    );
    let h = hidden
        .to_kind(Kind::BFloat16)
        .to_kind(Kind::Float)
        .set_requires_grad(true);
    let w = weight.to_kind(Kind::Float).set_requires_grad(true);
    let r = reference::linear_cross_entropy(&h, &w, &targets, -100, Reduction::Sum);
    let g = Tensor::run_backward(&[&r], &[&h, &w], false, false);
    let rel = |a: &Tensor, b: &Tensor| {
        (a - b).norm().double_value(&[]) / b.norm().double_value(&[]).max(1e-12)
    };
    assert!(rel(&loss, &r) < 1e-3, "loss {loss:?} vs {r:?}");
    assert!(rel(&gh, &g[0]) < 2e-2, "d hidden: {}", rel(&gh, &g[0]));
    assert!(rel(&gw, &g[1]) < 2e-2, "d weight: {}", rel(&gw, &g[1]));
}
