//! AdamW with decoupled weight decay (torch.optim.AdamW semantics, fp32 state), verl's learning-rate schedules, and
//! gradient-norm clipping.

use anyhow::{bail, Result};
use tch::{Kind, Tensor};

/// AdamW hyper-parameters.
#[derive(Clone, Copy, Debug)]
pub struct AdamWConfig {
    /// β1, β2.
    pub betas: (f64, f64),
    /// Denominator epsilon.
    pub eps: f64,
    /// Decoupled weight decay (multiplied by the learning rate).
    pub weight_decay: f64,
}

/// AdamW state: first and second moments per tensor and the number of steps taken.
pub struct AdamW {
    /// Hyper-parameters.
    pub config: AdamWConfig,
    /// First moments, one per master tensor.
    pub exp_avg: Vec<Tensor>,
    /// Second moments, one per master tensor.
    pub exp_avg_sq: Vec<Tensor>,
    /// Steps taken (the bias correction uses it).
    pub step: i64,
}

impl AdamW {
    /// Zero state for `params`.
    pub fn new(config: AdamWConfig, params: &[Tensor]) -> Self {
        Self {
            config,
            exp_avg: params.iter().map(Tensor::zeros_like).collect(),
            exp_avg_sq: params.iter().map(Tensor::zeros_like).collect(),
            step: 0,
        }
    }

    /// One update of `params` with `grads` at learning rate `lr`, as torch's single-tensor AdamW does it.
    pub fn step(&mut self, params: &mut [Tensor], grads: &[Tensor], lr: f64) {
        let _g = tch::no_grad_guard();
        self.step += 1;
        let (b1, b2) = self.config.betas;
        let bc1 = 1.0 - b1.powi(self.step as i32);
        let bc2_sqrt = (1.0 - b2.powi(self.step as i32)).sqrt();
        let step_size = lr / bc1;
        let work: Vec<[Tensor; 4]> = params
            .iter()
            .zip(grads)
            .zip(self.exp_avg.iter().zip(&self.exp_avg_sq))
            .flat_map(|((p, g), (m, v))| pieces([p, g, m, v]))
            .collect();
        let (scratch_a, scratch_b) = (Scratch::for_pieces(&work), Scratch::for_pieces(&work));
        for [mut p, g, mut m, mut v] in work {
            let (a, b) = (scratch_a.like(&p), scratch_b.like(&p));
            let _ = p.g_mul_scalar_(1.0 - lr * self.config.weight_decay);
            let _ = m.lerp_(&g, 1.0 - b1);
            let _ = v.g_mul_scalar_(b2);
            let _ = v.addcmul_(&g.mul_scalar_out(&a, 1.0 - b2), &g);
            let denom = v
                .sqrt_out(&a)
                .g_div_scalar_(bc2_sqrt)
                .g_add_scalar_(self.config.eps);
            let _ = p.addcdiv_(&m.mul_scalar_out(&b, -step_size), &denom);
        }
    }
}

/// Elements of the pieces [`AdamW::step`] updates a tensor in on `device`: its two temporaries hold one piece rather
/// than the largest tensor (a Qwen2.5-0.5B embedding: 545 MB each). The update is element-wise, so pieces give the
/// same values. On the CPU a piece is 4 MiB in fp32 (a temporary's pages are faulted in at each use and count in the
/// resident set); on CUDA 64 MiB, so that a large model's update is not a flood of small kernel launches.
fn piece_elements(device: tch::Device) -> i64 {
    match device {
        tch::Device::Cpu => 1 << 20,
        _ => 1 << 24,
    }
}

/// A parameter, its gradient and its two moments as flat pieces of at most [`piece_elements`] (views: the update
/// writes through them), or whole when one of them is not contiguous.
fn pieces(all: [&Tensor; 4]) -> Vec<[Tensor; 4]> {
    if !all.iter().all(|t| t.is_contiguous()) {
        return vec![all.map(Tensor::shallow_clone)];
    }
    let (numel, piece) = (all[0].numel() as i64, piece_elements(all[0].device()));
    (0..numel)
        .step_by(piece as usize)
        .map(|start| all.map(|t| t.view([-1]).narrow(0, start, piece.min(numel - start))))
        .collect()
}

/// A flat buffer as large as the largest piece ([`pieces`]), viewed in each piece's shape in turn: the temporaries of
/// [`AdamW::step`] (torch's single-tensor AdamW makes five per parameter) without a fresh allocation per piece,
/// which the C library maps and the kernel zeroes anew for every large one.
struct Scratch(Option<Tensor>);

impl Scratch {
    /// Room for the largest of the parameters' `pieces` (nothing for none), in their dtype and device.
    fn for_pieces(pieces: &[[Tensor; 4]]) -> Self {
        let largest = pieces.iter().map(|[p, ..]| p.numel()).max();
        Self(
            largest
                .zip(pieces.first().map(|[p, ..]| p))
                .map(|(n, p)| Tensor::empty([n as i64], (p.kind(), p.device()))),
        )
    }

    /// The buffer's first elements viewed as `p` (same shape, dtype and device; `p` a piece of the params).
    fn like(&self, p: &Tensor) -> Tensor {
        let flat = self.0.as_ref().expect("a scratch made for these params");
        flat.narrow(0, 0, p.numel() as i64)
            .view(p.size().as_slice())
    }
}

/// The learning-rate shape after warmup.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ScheduleKind {
    /// Half-cosine from the peak down to `min_lr_ratio * lr`.
    Cosine {
        /// Floor of the decay as a fraction of the peak.
        min_lr_ratio: f64,
    },
    /// Flat at the peak.
    Constant,
}

/// verl's schedules: linear warmup from 0 over `warmup_steps`, then cosine or constant.
#[derive(Clone, Copy, Debug)]
pub struct LrSchedule {
    /// Peak learning rate.
    pub lr: f64,
    /// Warmup steps (`int(total_steps * lr_warmup_steps_ratio)`).
    pub warmup_steps: i64,
    /// Total optimizer steps of the run.
    pub total_steps: i64,
    /// Shape after warmup.
    pub kind: ScheduleKind,
    /// Cosine half-waves over the decay (`optim.num_cycles`, 0.5 = one half cosine).
    pub num_cycles: f64,
}

impl LrSchedule {
    /// Builds the schedule from verl's keys; `name` is `cosine` or `constant`.
    pub fn from_verl(
        name: &str,
        lr: f64,
        warmup_ratio: f64,
        total_steps: i64,
        min_lr_ratio: f64,
    ) -> Result<Self> {
        let kind = match name {
            "cosine" => ScheduleKind::Cosine { min_lr_ratio },
            "constant" => ScheduleKind::Constant,
            other => bail!(
                "optim.lr_scheduler: `{other}` is not supported (supported: cosine, constant)"
            ),
        };
        if !(0.0..=1.0).contains(&min_lr_ratio) {
            bail!("optim.min_lr_ratio: {min_lr_ratio} is outside [0, 1]");
        }
        let warmup_steps = (total_steps as f64 * warmup_ratio) as i64;
        Ok(Self {
            lr,
            warmup_steps,
            total_steps,
            kind,
            num_cycles: 0.5,
        })
    }

    /// The learning rate of the optimizer step taken after `completed` earlier steps (LambdaLR's `current_step`).
    pub fn lr_at(&self, completed: i64) -> f64 {
        self.lr * self.factor(completed)
    }

    fn factor(&self, step: i64) -> f64 {
        let warm = self.warmup_steps;
        match self.kind {
            ScheduleKind::Constant => {
                if step < warm {
                    step as f64 / (warm.max(1) as f64)
                } else {
                    1.0
                }
            }
            ScheduleKind::Cosine { min_lr_ratio } => {
                if step < warm {
                    return step as f64 / warm.max(1) as f64;
                }
                let progress = (step - warm) as f64 / (self.total_steps - warm).max(1) as f64;
                let x = (std::f64::consts::PI * self.num_cycles * 2.0 * progress).cos();
                let coef = (1.0 - min_lr_ratio) * 0.5;
                let intercept = (1.0 + min_lr_ratio) * 0.5;
                (x * coef + intercept).max(min_lr_ratio)
            }
        }
    }
}

/// `Σ t²` in f64, a piece of [`piece_elements`] at a time: the squares' temporary holds one piece, not a copy of the
/// whole tensor (a gradient norm would otherwise copy the largest gradient, an embedding's, at the step's end).
pub fn sum_of_squares(t: &Tensor) -> f64 {
    let _g = tch::no_grad_guard();
    let flat = t.reshape([-1]);
    let (numel, elements) = (flat.numel() as i64, piece_elements(t.device()));
    let mut total = Tensor::zeros([], (Kind::Double, t.device()));
    for start in (0..numel).step_by(elements as usize) {
        let piece = flat.narrow(0, start, elements.min(numel - start));
        let _ = total.g_add_(&piece.square().sum(Kind::Double));
    }
    total.double_value(&[])
}

/// Scales `grads` so their global norm is at most `max_norm` (torch's `clip_grad_norm_`: factor
/// `max_norm / (norm + 1e-6)` clamped to 1). Does nothing when the norm is not finite.
pub fn clip_grads(grads: &mut [Tensor], norm: f64, max_norm: f64) {
    if !norm.is_finite() || max_norm <= 0.0 {
        return;
    }
    let coef = (max_norm / (norm + 1e-6)).min(1.0);
    if coef < 1.0 {
        let _g = tch::no_grad_guard();
        for g in grads {
            let _ = g.g_mul_scalar_(coef);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cosine_warms_up_linearly_then_decays_to_the_floor() {
        let s = LrSchedule::from_verl("cosine", 1.0, 0.1, 100, 0.1).unwrap();
        assert_eq!(s.warmup_steps, 10);
        assert_eq!(s.lr_at(0), 0.0);
        assert!((s.lr_at(5) - 0.5).abs() < 1e-12);
        assert!((s.lr_at(10) - 1.0).abs() < 1e-12);
        assert!((s.lr_at(55) - 0.55).abs() < 1e-12, "{}", s.lr_at(55));
        assert!((s.lr_at(100) - 0.1).abs() < 1e-12);
    }

    #[test]
    fn constant_holds_after_warmup_and_unknown_names_fail() {
        let s = LrSchedule::from_verl("constant", 2.0, 0.5, 10, 0.0).unwrap();
        assert!((s.lr_at(1) - 0.4).abs() < 1e-12);
        assert_eq!(s.lr_at(7), 2.0);
        let err = LrSchedule::from_verl("wsd", 1.0, 0.0, 10, 0.0)
            .unwrap_err()
            .to_string();
        assert!(err.contains("optim.lr_scheduler"), "{err}");
    }

    #[test]
    fn adamw_matches_the_closed_form_first_step() {
        let mut p = vec![Tensor::from_slice(&[1.0f32, -2.0])];
        let g = vec![Tensor::from_slice(&[0.5f32, 0.25])];
        let mut opt = AdamW::new(
            AdamWConfig {
                betas: (0.9, 0.95),
                eps: 1e-8,
                weight_decay: 0.1,
            },
            &p,
        );
        opt.step(&mut p, &g, 0.01);
        // First step: m̂ = g, v̂ = g², update = lr * g / (|g| + eps) ≈ lr * sign(g); decay first.
        let got: Vec<f32> = Vec::try_from(&p[0]).unwrap();
        assert!(
            (got[0] - (1.0 * (1.0 - 0.001) - 0.01)).abs() < 1e-6,
            "{got:?}"
        );
        assert!(
            (got[1] - (-2.0 * (1.0 - 0.001) - 0.01)).abs() < 1e-6,
            "{got:?}"
        );
    }

    /// torch's single-tensor AdamW written out whole, for the pieces' check.
    fn adamw_whole(
        p: &Tensor,
        g: &Tensor,
        m: &Tensor,
        v: &Tensor,
        step: i32,
        lr: f64,
    ) -> [Tensor; 3] {
        let (b1, b2, eps, wd) = (0.9, 0.95, 1e-8, 0.1);
        let p = p * (1.0 - lr * wd);
        let m = m * b1 + g * (1.0 - b1);
        let v = v * b2 + g * g * (1.0 - b2);
        let denom = v.sqrt() / (1.0 - b2.powi(step)).sqrt() + eps;
        let p = p - &m / denom * (lr / (1.0 - b1.powi(step)));
        [p, m, v]
    }

    #[test]
    fn a_sum_of_squares_in_pieces_equals_the_whole_sum() {
        let big = piece_elements(tch::Device::Cpu) * 2 + 5;
        let t = Tensor::arange(big, (Kind::Float, tch::Device::Cpu)).g_div_scalar(big as f64);
        let whole = t.square().sum(Kind::Double).double_value(&[]);
        let pieces = sum_of_squares(&t.view([big, 1]));
        assert!(
            (pieces - whole).abs() <= 1e-9 * whole,
            "{pieces} vs {whole}"
        );
    }

    #[test]
    fn adamw_in_pieces_equals_the_whole_update() {
        tch::manual_seed(3);
        let big = piece_elements(tch::Device::Cpu) * 2 + 5; // three pieces, the last of 5
        let transposed = Tensor::randn([3, 4], (tch::Kind::Float, tch::Device::Cpu)).tr(); // not contiguous: whole
        let mut p = vec![
            Tensor::randn([big], (tch::Kind::Float, tch::Device::Cpu)),
            transposed,
        ];
        let config = AdamWConfig {
            betas: (0.9, 0.95),
            eps: 1e-8,
            weight_decay: 0.1,
        };
        let mut opt = AdamW::new(config, &p);
        let mut want: Vec<[Tensor; 3]> = p
            .iter()
            .map(|t| [t.copy(), t.zeros_like(), t.zeros_like()])
            .collect();
        for step in 1..=2 {
            let g: Vec<Tensor> = p.iter().map(Tensor::randn_like).collect();
            opt.step(&mut p, &g, 0.01);
            for (w, g) in want.iter_mut().zip(&g) {
                *w = adamw_whole(&w[0], g, &w[1], &w[2], step, 0.01);
            }
        }
        for (i, (got, w)) in p.iter().zip(&want).enumerate() {
            let diff = (got - &w[0]).abs().max().double_value(&[]);
            assert!(diff < 1e-6, "tensor {i}: {diff}");
            let moments = (&opt.exp_avg_sq[i] - &w[2]).abs().max().double_value(&[]);
            assert!(moments < 1e-5, "tensor {i}'s second moment: {moments}");
        }
    }

    #[test]
    fn clipping_scales_to_the_bound_and_skips_non_finite_norms() {
        let mut g = vec![Tensor::from_slice(&[3.0f32, 4.0])];
        clip_grads(&mut g, 5.0, 1.0);
        let v: Vec<f32> = Vec::try_from(&g[0]).unwrap();
        assert!(
            (v[0] - 0.6).abs() < 1e-5 && (v[1] - 0.8).abs() < 1e-5,
            "{v:?}"
        );
        clip_grads(&mut g, f64::NAN, 1.0);
        let w: Vec<f32> = Vec::try_from(&g[0]).unwrap();
        assert_eq!(v, w);
    }
}
