//! Weights as one byte blob: [`WeightsPayload::from_tensors`] lays every tensor's bytes back to back (fp32 or bf16,
//! little-endian as the host holds them) behind a header of names and shapes; [`WeightsPayload::tensors`] reads
//! them back, and [`params_in_layout`] orders them as a model's layout lists its tensors.

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

    /// The tensors of `data` (a blob of this header) on the host.
    pub fn tensors(&self, data: &[u8]) -> Result<Vec<(String, Tensor)>> {
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

impl WeightsPayload {
    /// The payload of `named` tensors (any device and dtype), cast to `dtype`, in the given order.
    pub fn from_tensors(named: &[(String, &Tensor)], dtype: WireDtype) -> Self {
        let _g = tch::no_grad_guard();
        let kind = dtype.kind();
        let host: Vec<Tensor> = named
            .iter()
            .map(|(_, t)| t.detach().to_device(Device::Cpu).to_kind(kind).contiguous())
            .collect();
        let total: usize = host.iter().map(|t| t.numel() * dtype.size()).sum();
        let mut data = vec![0u8; total];
        let mut offset = 0;
        for t in &host {
            let n = t.numel();
            let end = offset + n * dtype.size();
            t.copy_data_u8(&mut data[offset..end], n);
            offset = end;
        }
        Self {
            header: WeightsHeader {
                names: named.iter().map(|(n, _)| n.clone()).collect(),
                shapes: host.iter().map(Tensor::size).collect(),
                dtype,
            },
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
