//! Weights as one byte blob: [`WeightsHeader::write`] lays every tensor's bytes back to back (fp32 or bf16,
//! little-endian as the host holds them) behind a header of names and shapes, into a [`WeightsPayload`] or an
//! object-store buffer; [`WeightsHeader::tensors`] reads them back, and [`params_in_layout`] orders them as a
//! model's layout lists its tensors.

use super::messages::{WeightsHeader, WeightsPayload, WireDtype};
use anyhow::{bail, Context, Result};
use ferl_trainer::model::layout::ModelLayout;
use std::collections::HashMap;
use tch::{Device, Kind, Tensor};

impl WireDtype {
    /// The tensor kind.
    pub fn kind(self) -> Kind {
        match self {
            Self::F32 => Kind::Float,
            Self::Bf16 => Kind::BFloat16,
        }
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::Bf16 => 2,
        }
    }
}

impl WeightsHeader {
    /// Elements of each tensor, in order.
    fn numels(&self) -> Vec<usize> {
        self.shapes
            .iter()
            .map(|s| s.iter().product::<i64>().max(0) as usize)
            .collect()
    }

    /// Bytes the blob must hold.
    pub fn bytes(&self) -> u64 {
        (self.numels().iter().sum::<usize>() * self.dtype.size()) as u64
    }

    /// Calls `f` with the tensors of `data` (a blob of this header) as views of its bytes, without copying them;
    /// `f` must not keep them (it copies what it needs). Where `data` is not aligned for the dtype, `f` gets copies.
    pub fn with_views<T>(
        &self,
        data: &[u8],
        f: impl FnOnce(Vec<(String, Tensor)>) -> Result<T>,
    ) -> Result<T> {
        self.check(data)?;
        if !(data.as_ptr() as usize).is_multiple_of(self.dtype.size()) {
            return f(self.tensors(data)?);
        }
        let mut offset = 0;
        let mut views = Vec::with_capacity(self.names.len());
        for ((name, shape), numel) in self.names.iter().zip(&self.shapes).zip(self.numels()) {
            let strides = contiguous_strides(shape);
            // SAFETY: the view covers `numel` elements at `offset`, inside `data` (its length was checked against
            // the header) and aligned for the dtype; `data` outlives the views, which are dropped when `f` returns
            // (a view `f` kept would be its caller's bug, as the doc says), and nothing writes through them.
            let view = unsafe {
                Tensor::from_blob(
                    data.as_ptr().add(offset),
                    shape,
                    &strides,
                    self.dtype.kind(),
                    Device::Cpu,
                )
            };
            views.push((name.clone(), view));
            offset += numel * self.dtype.size();
        }
        f(views)
    }

    /// Checks that `data` is a blob of this header.
    fn check(&self, data: &[u8]) -> Result<()> {
        if self.names.len() != self.shapes.len() {
            bail!(
                "weights header: {} names for {} shapes",
                self.names.len(),
                self.shapes.len()
            );
        }
        if data.len() as u64 != self.bytes() {
            bail!(
                "weights blob of {} bytes; its header describes {}",
                data.len(),
                self.bytes()
            );
        }
        Ok(())
    }

    /// The tensors of `data` (a blob of this header) on the host.
    pub fn tensors(&self, data: &[u8]) -> Result<Vec<(String, Tensor)>> {
        self.check(data)?;
        let (kind, size) = (self.dtype.kind(), self.dtype.size());
        let mut offset = 0;
        let mut out = Vec::with_capacity(self.names.len());
        for ((name, shape), numel) in self.names.iter().zip(&self.shapes).zip(self.numels()) {
            let end = offset + numel * size;
            out.push((
                name.clone(),
                Tensor::from_data_size(&data[offset..end], shape, kind),
            ));
            offset = end;
        }
        Ok(out)
    }
}

impl WeightsHeader {
    /// The header of `named` tensors sent as `dtype`, in the given order.
    pub fn of(named: &[(String, &Tensor)], dtype: WireDtype) -> Self {
        Self {
            names: named.iter().map(|(n, _)| n.clone()).collect(),
            shapes: named.iter().map(|(_, t)| t.size()).collect(),
            dtype,
        }
    }

    /// Writes `named` tensors (any device and dtype; those of [`WeightsHeader::of`]) into `out`, a blob of
    /// [`WeightsHeader::bytes`] bytes, each cast to this header's dtype.
    pub fn write(&self, named: &[(String, &Tensor)], out: &mut [u8]) -> Result<()> {
        if out.len() as u64 != self.bytes() || named.len() != self.names.len() {
            bail!(
                "weights blob of {} bytes for {} tensors; the header describes {} bytes in {}",
                out.len(),
                named.len(),
                self.bytes(),
                self.names.len()
            );
        }
        let _g = tch::no_grad_guard();
        let (kind, size) = (self.dtype.kind(), self.dtype.size());
        let mut offset = 0;
        for (_, t) in named {
            let host = t.detach().to_device(Device::Cpu).to_kind(kind).contiguous();
            let n = host.numel();
            let end = offset + n * size;
            host.copy_data_u8(&mut out[offset..end], n);
            offset = end;
        }
        Ok(())
    }
}

impl WeightsPayload {
    /// The payload of `named` tensors (any device and dtype), cast to `dtype`, in the given order.
    pub fn from_tensors(named: &[(String, &Tensor)], dtype: WireDtype) -> Self {
        let header = WeightsHeader::of(named, dtype);
        let mut data = vec![0u8; header.bytes() as usize];
        header
            .write(named, &mut data)
            .expect("a blob of the header's size");
        Self {
            header,
            data: data.into(),
        }
    }

    /// Bytes of the blob.
    pub fn bytes(&self) -> u64 {
        self.data.len() as u64
    }

    /// The tensors on the host, by name, in order.
    pub fn tensors(&self) -> Result<Vec<(String, Tensor)>> {
        self.header.tensors(&self.data)
    }
}

/// The strides of a contiguous tensor of `shape`.
fn contiguous_strides(shape: &[i64]) -> Vec<i64> {
    let mut strides = vec![1; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1] * shape[i + 1].max(1);
    }
    strides
}

/// `named` tensors in the order of `layout.tensors`: every tensor of the layout must be there once, with its
/// shape; extra names are an error too (a payload of another model).
pub fn params_in_layout(layout: &ModelLayout, named: Vec<(String, Tensor)>) -> Result<Vec<Tensor>> {
    if named.len() != layout.tensors.len() {
        bail!(
            "{} tensors in the weights for a model of {}",
            named.len(),
            layout.tensors.len()
        );
    }
    let mut by_name: HashMap<String, Tensor> = named.into_iter().collect();
    layout
        .tensors
        .iter()
        .map(|(name, shape)| {
            let t = by_name
                .remove(name)
                .with_context(|| format!("the weights have no tensor {name}"))?;
            if t.size() != *shape {
                bail!(
                    "weights tensor {name} is {:?}; the model's is {shape:?}",
                    t.size()
                );
            }
            Ok(t)
        })
        .collect()
}
