//! Pictures of a run without a server: the curves a run logged to `metrics.jsonl` (one JSON object per step,
//! `{"step": N, "train/loss": ..., ...}`) drawn to a PNG or an SVG with [plotters]. One panel per quantity, with
//! axes, a grid and a legend; validation values (`val/…`, `val-core/…`) are points over the line of their training
//! counterpart (`train/loss` and `val/loss` share the panel `loss`). A resumed or restarted run logs the steps after
//! its checkpoint again: the last value logged for a step is the one drawn.
//!
//! `ferl plot` draws any run; every `ferl sft` / `ferl grpo` run writes `curves.png` beside its `metrics.jsonl` when
//! it ends, a failed one up to the failure ([`CURVES_FILE`]).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use anyhow::{bail, Context as _, Result};
use plotters::coord::Shift;
use plotters::prelude::*;

/// The picture a run writes beside its `metrics.jsonl`.
pub const CURVES_FILE: &str = "curves.png";

/// What a run's picture shows when no metrics are named: those of these the run logged (SFT's losses, learning
/// rate and gradient norm; RL's score, losses, KL, entropy and response length).
pub const DEFAULT_METRICS: &[&str] = &[
    "train/loss",
    "val/loss",
    "critic/score/mean",
    "actor/pg_loss",
    "actor/kl_loss",
    "actor/entropy",
    "response_length/mean",
    "train/lr",
    "actor/lr",
    "train/grad_norm",
    "actor/grad_norm",
];

/// The font every label is drawn in (embedded: no system font lookup, so pictures draw on any host).
const FONT: &str = "sans-serif";
static FONT_BYTES: &[u8] = include_bytes!("../../../assets/fonts/DejaVuSans.ttf");

/// Each metric's `(step, value)` points, in step order.
pub type Series = BTreeMap<String, Vec<(u64, f64)>>;

/// The metrics of a `metrics.jsonl` (or of the one in the run folder `input`): per key its finite values by step,
/// the last line of a step winning. A line that is not a JSON object with a `step` is refused, naming its line.
pub fn read_metrics(input: &Path) -> Result<Series> {
    let path = metrics_file(input);
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let mut by_key: BTreeMap<String, BTreeMap<u64, f64>> = BTreeMap::new();
    for (i, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let at = || format!("{} line {}", path.display(), i + 1);
        let value: serde_json::Value = serde_json::from_str(line).with_context(at)?;
        let Some(step) = value.get("step").and_then(serde_json::Value::as_u64) else {
            bail!("{}: no `step`", at());
        };
        for (k, v) in value.as_object().into_iter().flatten() {
            if let Some(x) = v.as_f64().filter(|x| x.is_finite() && k != "step") {
                by_key.entry(k.clone()).or_default().insert(step, x);
            }
        }
    }
    Ok(by_key
        .into_iter()
        .map(|(k, points)| (k, points.into_iter().collect()))
        .collect())
}

/// `input` itself, or the `metrics.jsonl` in the folder `input`.
fn metrics_file(input: &Path) -> PathBuf {
    match input.is_dir() {
        true => input.join("metrics.jsonl"),
        false => input.to_path_buf(),
    }
}

/// Draws `metrics` of `series` (all of them must be there), else the [`DEFAULT_METRICS`] it has (else its first
/// keys), to `out`: an SVG when its name ends in `.svg`, else a PNG.
pub fn draw(series: &Series, metrics: Option<&[String]>, out: &Path) -> Result<()> {
    let chosen = choose(series, metrics)?;
    let panels = panels(&chosen);
    let rows = panels.len().div_ceil(2).max(1) as u32;
    let size = (1200, 380 * rows);
    let svg = out.extension().is_some_and(|e| e == "svg");
    if let Some(dir) = out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    register_font();
    let written = match svg {
        true => draw_on(
            SVGBackend::new(out, size).into_drawing_area(),
            series,
            &panels,
        ),
        false => draw_on(
            BitMapBackend::new(out, size).into_drawing_area(),
            series,
            &panels,
        ),
    };
    written.with_context(|| format!("drawing {}", out.display()))
}

/// Reads the run's metrics (`input`: a run folder or its `metrics.jsonl`) and draws them to `out` ([`draw`]).
pub fn plot(input: &Path, metrics: Option<&[String]>, out: &Path) -> Result<()> {
    draw(&read_metrics(input)?, metrics, out)
}

/// The keys to draw.
fn choose(series: &Series, metrics: Option<&[String]>) -> Result<Vec<String>> {
    if let Some(named) = metrics {
        if let Some(missing) = named.iter().find(|k| !series.contains_key(*k)) {
            let known: Vec<&str> = series.keys().map(String::as_str).collect();
            bail!(
                "--metrics: the run logged no `{missing}` (it logged: {})",
                known.join(", ")
            );
        }
        return Ok(named.to_vec());
    }
    let defaults: Vec<String> = DEFAULT_METRICS
        .iter()
        .filter(|k| series.contains_key(**k))
        .map(|k| k.to_string())
        .collect();
    match (defaults.is_empty(), series.is_empty()) {
        (_, true) => bail!("the run logged no metrics yet"),
        (false, _) => Ok(defaults),
        (true, _) => Ok(series.keys().take(6).cloned().collect()),
    }
}

/// The panel a key is drawn in: training and validation values of one quantity share it.
fn panel_of(key: &str) -> &str {
    ["train/", "val-core/", "val/"]
        .iter()
        .find_map(|p| key.strip_prefix(p))
        .unwrap_or(key)
}

/// Whether `key` holds validation values (drawn as points).
fn is_validation(key: &str) -> bool {
    key.starts_with("val/") || key.starts_with("val-core/")
}

/// The panels in order of their first key, each with its keys.
fn panels(keys: &[String]) -> Vec<(String, Vec<String>)> {
    let mut out: Vec<(String, Vec<String>)> = Vec::new();
    for k in keys {
        let name = panel_of(k);
        match out.iter_mut().find(|(n, _)| n == name) {
            Some((_, ks)) => ks.push(k.clone()),
            None => out.push((name.to_string(), vec![k.clone()])),
        }
    }
    out
}

fn register_font() {
    static DONE: OnceLock<()> = OnceLock::new();
    DONE.get_or_init(|| {
        // The embedded font is a valid TrueType file: registering it cannot fail.
        let _ = plotters::style::register_font(FONT, FontStyle::Normal, FONT_BYTES);
    });
}

/// Draws every panel on `area`, two per row.
fn draw_on<DB: DrawingBackend>(
    area: DrawingArea<DB, Shift>,
    series: &Series,
    panels: &[(String, Vec<String>)],
) -> Result<()>
where
    DB::ErrorType: 'static,
{
    area.fill(&WHITE).map_err(plot_error)?;
    let rows = panels.len().div_ceil(2).max(1);
    let cols = if panels.len() > 1 { 2 } else { 1 };
    let cells = area.split_evenly((rows, cols));
    for ((name, keys), cell) in panels.iter().zip(cells.iter()) {
        draw_panel(cell, name, keys, series)?;
    }
    area.present().map_err(plot_error)?;
    Ok(())
}

/// One panel: the keys' curves against the step, with axes, grid and legend.
fn draw_panel<DB: DrawingBackend>(
    cell: &DrawingArea<DB, Shift>,
    name: &str,
    keys: &[String],
    series: &Series,
) -> Result<()>
where
    DB::ErrorType: 'static,
{
    let points: Vec<&(u64, f64)> = keys.iter().flat_map(|k| &series[k]).collect();
    let (x, y) = ranges(&points);
    // Tiny (learning rates) or huge values read best in scientific notation.
    let scale = y.start.abs().max(y.end.abs());
    let scientific = !(1e-2..1e5).contains(&scale);
    // Steps are whole numbers: at most one label per step.
    let x_labels = ((x.end - x.start) as usize).clamp(2, 10);
    let mut chart = ChartBuilder::on(cell)
        .caption(name, (FONT, 22))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(x, y)
        .map_err(plot_error)?;
    chart
        .configure_mesh()
        .x_labels(x_labels)
        .x_label_formatter(&|s| format!("{s:.0}"))
        .y_label_formatter(&|v| tick(*v, scientific))
        .x_desc("step")
        .y_desc(name)
        .label_style((FONT, 14))
        .axis_desc_style((FONT, 15))
        .draw()
        .map_err(plot_error)?;
    for (i, key) in keys.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        let data: Vec<(f64, f64)> = series[key].iter().map(|&(s, v)| (s as f64, v)).collect();
        let drawn = match is_validation(key) {
            true => chart.draw_series(
                data.iter()
                    .map(|&p| Circle::new(p, 5, color.filled()).into_dyn()),
            ),
            false => chart.draw_series(std::iter::once(
                PathElement::new(data.clone(), color.stroke_width(2)).into_dyn(),
            )),
        };
        let validation = is_validation(key);
        drawn
            .map_err(plot_error)?
            .label(key.as_str())
            .legend(move |(x, y)| match validation {
                true => Circle::new((x + 9, y), 5, color.filled()).into_dyn(),
                false => {
                    PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(3)).into_dyn()
                }
            });
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font((FONT, 14))
        .draw()
        .map_err(plot_error)?;
    Ok(())
}

/// The step and value ranges of `points`, widened where they are a single value.
fn ranges(points: &[&(u64, f64)]) -> (std::ops::Range<f64>, std::ops::Range<f64>) {
    let steps = points.iter().map(|p| p.0 as f64);
    let values = points.iter().map(|p| p.1);
    let (x0, x1) = bounds(steps);
    let (y0, y1) = bounds(values);
    let x = if x1 > x0 { x0..x1 } else { x0 - 1.0..x1 + 1.0 };
    let pad = match (y1 > y0, y0 != 0.0) {
        (true, _) => (y1 - y0) * 0.05,
        (false, true) => y0.abs() * 0.1,
        (false, false) => 1.0,
    };
    (x, y0 - pad..y1 + pad)
}

/// A value axis label: scientific for tiny or huge scales, else up to 4 decimals without trailing zeros.
fn tick(v: f64, scientific: bool) -> String {
    if scientific {
        return format!("{v:.2e}");
    }
    let text = format!("{v:.4}");
    let text = text.trim_end_matches('0').trim_end_matches('.');
    match text {
        "-0" => "0".into(),
        t => t.into(),
    }
}

fn bounds(values: impl Iterator<Item = f64>) -> (f64, f64) {
    values.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
        (lo.min(v), hi.max(v))
    })
}

fn plot_error<E: std::error::Error + Send + Sync + 'static>(
    e: DrawingAreaErrorKind<E>,
) -> anyhow::Error {
    anyhow::anyhow!("{e}")
}

#[cfg(test)]
mod tests;
