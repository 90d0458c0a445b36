//! RoPE settings of a `config.json` and the inverse frequencies they imply, as transformers 5.24 computes them
//! (`modeling_rope_utils`): the `default`, `linear` and `llama3` rope types, read from `rope_scaling` or
//! `rope_parameters` with transformers' precedence. Every other rope type is refused.

use anyhow::{bail, Result};
use serde_json::{Map, Value};
use std::path::Path;
use tch::{Device, Kind, Tensor};

/// The rope types [`RopeScaling`] implements, for error messages.
const SUPPORTED: &str = "default, linear, llama3";

/// How RoPE's inverse frequencies are derived from the default ones (transformers' `rope_type`). None of the
/// supported types scales cos/sin (their `attention_factor` is 1).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum RopeScaling {
    /// `default`: `inv_freq[i] = 1 / theta^(2i / head_dim)`.
    Default,
    /// `linear` (position interpolation, e.g. deepseek-coder): every default frequency divided by `factor`.
    Linear {
        /// The divisor of every frequency.
        factor: f64,
    },
    /// `llama3` (Llama 3.1+): wavelengths above `original_max_position_embeddings / low_freq_factor` are divided by
    /// `factor`, those below `original_max_position_embeddings / high_freq_factor` kept, those between interpolated.
    Llama3 {
        /// The divisor of the low frequencies.
        factor: f64,
        /// Sets the low-frequency wavelength bound.
        low_freq_factor: f64,
        /// Sets the high-frequency wavelength bound.
        high_freq_factor: f64,
        /// The pre-training context length.
        original_max_position_embeddings: f64,
    },
}

/// The RoPE section of a config: where its parameters came from, read with transformers' precedence.
struct Source<'a> {
    /// `rope_scaling` or `rope_parameters`, for error messages.
    field: &'static str,
    /// The parameters (empty for plain RoPE).
    params: Map<String, Value>,
    raw: &'a Value,
    file: &'a Path,
}

impl Source<'_> {
    /// A number from the parameters, or the top-level key of the same name when `top_level` (top level first).
    fn number(&self, key: &str, top_level: bool) -> Result<Option<f64>> {
        let found = match (top_level, self.raw.get(key).filter(|v| !v.is_null())) {
            (true, Some(v)) => Some((key.to_string(), v)),
            _ => self
                .params
                .get(key)
                .filter(|v| !v.is_null())
                .map(|v| (format!("{}.{key}", self.field), v)),
        };
        match found {
            None => Ok(None),
            Some((name, v)) => match v.as_f64() {
                Some(x) => Ok(Some(x)),
                None => bail!("{}: `{name}` is {v}, not a number", self.file.display()),
            },
        }
    }

    /// A number the rope type requires.
    fn required(&self, key: &str, rope_type: &str) -> Result<f64> {
        match self.number(key, false)? {
            Some(x) => Ok(x),
            None => bail!(
                "{}: `{}.{key}` is missing (rope_type `{rope_type}` requires it)",
                self.file.display(),
                self.field
            ),
        }
    }
}

/// `rope_scaling` when it is a non-empty object, else `rope_parameters` (transformers'
/// `rope_scaling or rope_parameters`).
fn source<'a>(raw: &'a Value, file: &'a Path) -> Result<Source<'a>> {
    let mut chosen = None;
    for field in ["rope_scaling", "rope_parameters"] {
        match raw.get(field) {
            None | Some(Value::Null) => {}
            Some(Value::Object(m)) if m.is_empty() => {}
            Some(Value::Object(m)) => {
                chosen = Some((field, m.clone()));
                break;
            }
            Some(other) => bail!("{}: `{field}` is {other}, not an object", file.display()),
        }
    }
    let (field, params) = chosen.unwrap_or(("rope_parameters", Map::new()));
    if let Some((key, _)) = params.iter().find(|(_, v)| v.is_object()) {
        bail!(
            "{}: `{field}.{key}`: per-layer-type RoPE parameters are not supported",
            file.display()
        );
    }
    Ok(Source {
        field,
        params,
        raw,
        file,
    })
}

/// Reads `(rope_theta, scaling)` from a parsed `config.json`; `max_position_embeddings` is the config's (or its
/// class default), which `llama3` falls back to like transformers. Errors name `file` and the offending field.
pub fn parse(raw: &Value, max_position_embeddings: i64, file: &Path) -> Result<(f64, RopeScaling)> {
    let src = source(raw, file)?;
    let type_key = ["rope_type", "type"]
        .into_iter()
        .find(|k| src.params.get(*k).is_some_and(|v| !v.is_null()));
    let rope_type = match type_key {
        None => "default",
        Some(k) => match src.params[k].as_str() {
            Some(t) => t,
            None => bail!(
                "{}: `{}.{k}` is {}, not a string",
                file.display(),
                src.field,
                src.params[k]
            ),
        },
    };
    let theta = src.number("rope_theta", false)?;
    let theta = match theta {
        Some(t) => t,
        None => src.number("rope_theta", true)?.unwrap_or(10000.0),
    };
    for top_level in [false, true] {
        if let Some(f) = src.number("partial_rotary_factor", top_level)? {
            if f != 1.0 {
                let name = if top_level {
                    "partial_rotary_factor".to_string()
                } else {
                    format!("{}.partial_rotary_factor", src.field)
                };
                bail!(
                    "{}: `{name}` {f} is not supported (only full rotary embeddings)",
                    file.display()
                );
            }
        }
    }
    let scaling = match rope_type {
        "default" => RopeScaling::Default,
        "linear" => RopeScaling::Linear {
            factor: src.required("factor", rope_type)?,
        },
        "llama3" => RopeScaling::Llama3 {
            factor: src.required("factor", rope_type)?,
            low_freq_factor: src.required("low_freq_factor", rope_type)?,
            high_freq_factor: src.required("high_freq_factor", rope_type)?,
            // A top-level value wins over the parameters' (transformers' Phi3 exception), then the parameters',
            // then max_position_embeddings.
            original_max_position_embeddings: src
                .number("original_max_position_embeddings", true)?
                .unwrap_or(max_position_embeddings as f64),
        },
        other => bail!(
            "{}: `{}.{}` `{other}` is not supported (supported: {SUPPORTED})",
            file.display(),
            src.field,
            type_key.unwrap_or("rope_type")
        ),
    };
    Ok((theta, scaling))
}

/// The inverse frequencies `[head_dim / 2]` (fp32) for base `theta`, computed on the CPU with the same ops as
/// transformers (so the values match bit for bit), then moved to `device`.
pub fn inv_freq(theta: f64, scaling: RopeScaling, head_dim: i64, device: Device) -> Tensor {
    let cpu = (Kind::Int64, Device::Cpu);
    let exponent =
        Tensor::arange_start_step(0, head_dim, 2, cpu).to_kind(Kind::Float) / head_dim as f64;
    let inv = Tensor::pow_scalar(theta, &exponent).reciprocal();
    let inv = match scaling {
        RopeScaling::Default => inv,
        RopeScaling::Linear { factor } => inv / factor,
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings: old,
        } => {
            let low_wavelen = old / low_freq_factor;
            let high_wavelen = old / high_freq_factor;
            let wavelen = inv.reciprocal() * (2.0 * std::f64::consts::PI);
            let scaled = (&inv / factor).where_self(&wavelen.gt(low_wavelen), &inv);
            let smooth = (wavelen.reciprocal() * old - low_freq_factor)
                / (high_freq_factor - low_freq_factor);
            let smoothed = (smooth.neg() + 1.0) * &scaled / factor + &smooth * &scaled;
            let medium = wavelen
                .lt(high_wavelen)
                .logical_not()
                .logical_and(&wavelen.gt(low_wavelen).logical_not());
            smoothed.where_self(&medium, &scaled)
        }
    };
    inv.to_device(device)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parsed(v: Value) -> Result<(f64, RopeScaling)> {
        parse(&v, 2048, Path::new("config.json"))
    }

    #[test]
    fn precedence_follows_transformers() {
        // rope_scaling wins over rope_parameters, its theta over the top-level one, `rope_type` over `type`.
        let v = json!({"rope_parameters": {"rope_type": "linear", "factor": 3.0, "rope_theta": 5.0},
                       "rope_scaling": {"type": "linear", "factor": 2.0}, "rope_theta": 7.0});
        assert_eq!(
            parsed(v).unwrap(),
            (7.0, RopeScaling::Linear { factor: 2.0 })
        );
        let v = json!({"rope_parameters": {"rope_type": "default", "rope_theta": 5.0}, "rope_theta": 7.0});
        assert_eq!(parsed(v).unwrap(), (5.0, RopeScaling::Default));
        let v = json!({"rope_scaling": {"type": "linear", "rope_type": "default", "factor": 2.0}});
        assert_eq!(parsed(v).unwrap(), (10000.0, RopeScaling::Default));
        assert_eq!(
            parsed(json!({"rope_scaling": null})).unwrap(),
            (10000.0, RopeScaling::Default)
        );
        let llama3 = json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0});
        let RopeScaling::Llama3 {
            original_max_position_embeddings: omp,
            ..
        } = parsed(json!({ "rope_parameters": llama3 })).unwrap().1
        else {
            panic!("llama3 expected")
        };
        assert_eq!(omp, 2048.0, "falls back to max_position_embeddings");
        let mut with_own = llama3.clone();
        with_own["original_max_position_embeddings"] = json!(64);
        let v = json!({"rope_scaling": with_own, "original_max_position_embeddings": 32});
        let RopeScaling::Llama3 {
            original_max_position_embeddings: omp,
            ..
        } = parsed(v).unwrap().1
        else {
            panic!("llama3 expected")
        };
        assert_eq!(omp, 32.0, "a top-level value wins");
    }

    #[test]
    fn unsupported_or_incomplete_rope_settings_are_refused_by_name() {
        let cases = [
            (
                json!({"rope_scaling": {"type": "yarn", "factor": 4.0}}),
                "rope_scaling.type",
            ),
            (
                json!({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}),
                "rope_parameters.rope_type",
            ),
            (
                json!({"rope_scaling": {"rope_type": "longrope"}}),
                "`longrope`",
            ),
            (
                json!({"rope_scaling": {"rope_type": "linear"}}),
                "rope_scaling.factor",
            ),
            (
                json!({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}}),
                "rope_parameters.high_freq_factor",
            ),
            (
                json!({"partial_rotary_factor": 0.5}),
                "partial_rotary_factor",
            ),
            (
                json!({"rope_scaling": {"full_attention": {"rope_type": "default"}}}),
                "rope_scaling.full_attention",
            ),
            (json!({"rope_scaling": "linear"}), "rope_scaling"),
        ];
        for (v, field) in cases {
            let err = format!("{:#}", parsed(v.clone()).expect_err(&v.to_string()));
            assert!(
                err.contains("config.json") && err.contains(field),
                "{v}: {err}"
            );
        }
    }

    #[test]
    fn llama3_keeps_high_scales_low_and_interpolates_medium_frequencies() {
        let plain = inv_freq(10000.0, RopeScaling::Default, 16, Device::Cpu);
        let s = RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 32.0,
        };
        let scaled = inv_freq(10000.0, s, 16, Device::Cpu);
        let (p, q): (Vec<f32>, Vec<f32>) = (
            Vec::try_from(&plain).unwrap(),
            Vec::try_from(&scaled).unwrap(),
        );
        // Wavelengths 2*pi*10000^(i/8): 6.3 (< 8: kept), 19.9 (between 8 and 32: interpolated), then > 32 (/ 8).
        assert_eq!(p[0], q[0]);
        assert!(q[1] < p[1] && q[1] > p[1] / 8.0);
        for i in 2..8 {
            assert_eq!(q[i], p[i] / 8.0, "frequency {i}");
        }
        let linear = inv_freq(
            10000.0,
            RopeScaling::Linear { factor: 2.0 },
            16,
            Device::Cpu,
        );
        let l: Vec<f32> = Vec::try_from(&linear).unwrap();
        assert!(p.iter().zip(&l).all(|(a, b)| *b == a / 2.0));
    }
}
