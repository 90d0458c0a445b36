//! Kernel plugins on the host side: find an op by name and call its forward/backward with a [`HostOps`] table the
//! caller (a tensor library adapter such as `ferl-plugin-tch`) provides.

use crate::library::{KindTable, LoadedPlugin};
use crate::PluginCallError;
use anyhow::{anyhow, Result};
use ferl_plugin_abi::kernel::{HostOps, KernelOp, KernelVTable, TensorHandle};
use ferl_plugin_abi::ErrorMessage;
use std::sync::Arc;

/// One op of a loaded kernel plugin. Holds the plugin version alive while it exists.
#[derive(Clone)]
pub struct KernelOpRef {
    plugin: Arc<LoadedPlugin>,
    op: &'static KernelOp,
    name: String,
}

/// The ops of a loaded kernel table and their names (`?` for a name that is not UTF-8, which loading refuses).
fn ops_and_names(table: &'static KernelVTable) -> (&'static [KernelOp], Vec<&'static str>) {
    // SAFETY: both callers pass the table of a `KindTable::Kernel`, checked by `load_table`/`check_kernel_ops` when
    // the plugin loaded (or a built-in `'static` table): its `n_ops` ops and their names are data of the plugin's
    // library and stay valid while the `LoadedPlugin` holding it lives, which the callers hold meanwhile (`find`
    // moves its `Arc` into the `KernelOpRef` that keeps the op).
    unsafe {
        let ops = table.ops();
        let names = ops.iter().map(|o| o.name.to_str().unwrap_or("?")).collect();
        (ops, names)
    }
}

impl KernelOpRef {
    /// Op `name` of kernel plugin `plugin`; the error lists the ops it has.
    pub fn find(plugin: Arc<LoadedPlugin>, name: &str) -> Result<Self> {
        let KindTable::Kernel(table) = plugin.table else {
            return Err(anyhow!(
                "plugin {} is a {} plugin, not a kernel",
                plugin.label(),
                plugin.info().kind.as_str()
            ));
        };
        let (ops, names) = ops_and_names(table);
        let idx = names.iter().position(|n| *n == name).ok_or_else(|| {
            anyhow!(
                "kernel plugin {} has no op `{name}` (it has: {})",
                plugin.label(),
                names.join(", ")
            )
        })?;
        Ok(Self {
            op: &ops[idx],
            plugin,
            name: name.to_string(),
        })
    }

    /// The op names of kernel plugin `plugin`.
    pub fn op_names(plugin: &LoadedPlugin) -> Vec<String> {
        match plugin.table {
            KindTable::Kernel(t) => ops_and_names(t).1.into_iter().map(str::to_string).collect(),
            _ => Vec::new(),
        }
    }

    /// The plugin version serving this op.
    pub fn plugin(&self) -> &Arc<LoadedPlugin> {
        &self.plugin
    }

    /// `(inputs, outputs, saved)` counts.
    pub fn arity(&self) -> (usize, usize, usize) {
        (
            self.op.n_inputs as usize,
            self.op.n_outputs as usize,
            self.op.n_saved as usize,
        )
    }

    /// Runs forward: returns `n_outputs` outputs then `n_saved` saved handles, all owned by the caller.
    pub fn forward(
        &self,
        host: &HostOps,
        inputs: &[TensorHandle],
        attrs: &[f64],
    ) -> Result<Vec<TensorHandle>, PluginCallError> {
        let (ni, no, ns) = self.arity();
        self.check_count("forward", "inputs", inputs.len(), ni)?;
        let mut out = vec![TensorHandle::NULL; no + ns];
        let mut err = ErrorMessage::new();
        // SAFETY: `inputs` has n_inputs handles, `out` room for n_outputs + n_saved; all outlive the call.
        let status = unsafe {
            (self.op.forward)(
                host,
                inputs.as_ptr(),
                attrs.as_ptr(),
                attrs.len(),
                out.as_mut_ptr(),
                err.as_mut_ptr(),
            )
        };
        self.plugin
            .check(format!("{}.forward", self.name), status, &err)?;
        Ok(out)
    }

    /// Runs backward: returns one gradient handle per input (null: none), owned by the caller.
    pub fn backward(
        &self,
        host: &HostOps,
        grad_outputs: &[TensorHandle],
        inputs: &[TensorHandle],
        saved: &[TensorHandle],
        attrs: &[f64],
    ) -> Result<Vec<TensorHandle>, PluginCallError> {
        let (ni, no, ns) = self.arity();
        self.check_count("backward", "output gradients", grad_outputs.len(), no)?;
        self.check_count("backward", "inputs", inputs.len(), ni)?;
        self.check_count("backward", "saved tensors", saved.len(), ns)?;
        let mut grads = vec![TensorHandle::NULL; ni];
        let mut err = ErrorMessage::new();
        // SAFETY: every slice has the length the op declares and outlives the call.
        let status = unsafe {
            (self.op.backward)(
                host,
                grad_outputs.as_ptr(),
                inputs.as_ptr(),
                saved.as_ptr(),
                attrs.as_ptr(),
                attrs.len(),
                grads.as_mut_ptr(),
                err.as_mut_ptr(),
            )
        };
        self.plugin
            .check(format!("{}.backward", self.name), status, &err)?;
        Ok(grads)
    }

    fn check_count(
        &self,
        call: &str,
        what: &str,
        got: usize,
        want: usize,
    ) -> Result<(), PluginCallError> {
        if got == want {
            return Ok(());
        }
        Err(PluginCallError {
            plugin: self.plugin.label(),
            file: self.plugin.info().file.display().to_string(),
            call: format!("{}.{call}", self.name),
            message: format!("given {got} {what}, the op takes {want}"),
            panicked: false,
        })
    }
}
