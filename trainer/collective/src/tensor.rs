//! Checks that a tensor can be handed to a collective, and access to its memory as raw bytes.

use crate::dtype::DType;
use anyhow::{bail, Result};
use tch::{Device, Tensor};

/// A contiguous tensor's memory: where it starts, how many elements, of which type.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RawTensor {
    pub ptr: *mut u8,
    pub numel: usize,
    pub dtype: DType,
}

impl RawTensor {
    /// The tensor's memory; `what` names the argument in errors ("input of all_gather").
    pub(crate) fn of(
        tensor: &Tensor,
        device_is_ok: impl Fn(Device) -> bool,
        what: &str,
    ) -> Result<Self> {
        let device = tensor.device();
        if !device_is_ok(device) {
            bail!("{what}: tensor on {device:?} is not on this communicator's device");
        }
        if !tensor.is_contiguous() {
            bail!(
                "{what}: tensor of shape {:?} is not contiguous (call .contiguous() first)",
                tensor.size()
            );
        }
        let dtype = DType::from_kind(tensor.kind())?;
        let numel = tensor.numel();
        let ptr = if numel == 0 {
            std::ptr::null_mut()
        } else {
            tensor.data_ptr() as *mut u8
        };
        Ok(Self { ptr, numel, dtype })
    }

    /// Size in bytes.
    pub(crate) fn bytes(&self) -> usize {
        self.numel * self.dtype.size()
    }
}

/// Fails unless `output` has `expected` elements of the same type as `input`.
pub(crate) fn check_pair(
    what: &str,
    input: &RawTensor,
    output: &RawTensor,
    expected: usize,
) -> Result<()> {
    if output.dtype != input.dtype {
        bail!(
            "{what}: output is {:?} but input is {:?}",
            output.dtype,
            input.dtype
        );
    }
    if output.numel != expected {
        bail!(
            "{what}: output has {} elements, expected {expected} (input has {})",
            output.numel,
            input.numel
        );
    }
    Ok(())
}

/// Whether `device` is the CPU.
pub(crate) fn is_cpu(device: Device) -> bool {
    device == Device::Cpu
}
