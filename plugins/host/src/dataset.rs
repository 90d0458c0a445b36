//! Dataset plugins on the host side: open an instance, read its length and copy examples out.

use crate::library::{KindTable, LoadedPlugin};
use crate::PluginCallError;
use anyhow::{anyhow, Result};
use ferl_plugin_abi::dataset::{
    DatasetVTable, Example, EXAMPLE_MESSAGES_JSON, EXAMPLE_PROMPT_RESPONSE, EXAMPLE_TOKENS,
};
use ferl_plugin_abi::{ErrorMessage, FerlStr};
use std::ffi::c_void;
use std::sync::Arc;

/// An example copied out of a dataset plugin.
#[derive(Clone, Debug, PartialEq)]
pub enum DatasetExample {
    /// A prompt and the response to learn.
    PromptResponse {
        /// The prompt.
        prompt: String,
        /// The response.
        response: String,
    },
    /// A chat as JSON (`[{"role": ..., "content": ...}, ...]`).
    MessagesJson(String),
    /// Ready token ids and their loss mask (1 = trained on).
    Tokens {
        /// Token ids.
        input_ids: Vec<i64>,
        /// Loss mask, same length.
        loss_mask: Vec<u8>,
    },
}

/// One open dataset. After a panic inside the plugin the instance refuses further calls (its state is unknown).
pub struct DatasetInstance {
    plugin: Arc<LoadedPlugin>,
    table: &'static DatasetVTable,
    inst: *mut c_void,
    len: u64,
    poisoned: Option<String>,
}

// SAFETY: used by one thread at a time (`&mut self` for every call into the plugin).
unsafe impl Send for DatasetInstance {}

impl DatasetInstance {
    /// Opens `plugin` (a dataset) with `config` and reads its length.
    pub fn open(plugin: Arc<LoadedPlugin>, config: &str) -> Result<Self> {
        let KindTable::Dataset(table) = plugin.table else {
            return Err(anyhow!(
                "plugin {} is a {} plugin, not a dataset",
                plugin.label(),
                plugin.info().kind.as_str()
            ));
        };
        let inst = plugin.open_instance(table.open, format!("open({config})"), config)?;
        let mut me = Self {
            plugin,
            table,
            inst,
            len: 0,
            poisoned: None,
        };
        let (mut len, mut err) = (0u64, ErrorMessage::new());
        // SAFETY: the instance is open.
        let status = unsafe { (table.len)(inst, &mut len, err.as_mut_ptr()) };
        me.plugin.check("len", status, &err)?;
        me.len = len;
        Ok(me)
    }

    /// The plugin version serving this dataset.
    pub fn plugin(&self) -> &Arc<LoadedPlugin> {
        &self.plugin
    }

    /// Number of examples.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether there are no examples.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Example `index`, copied.
    pub fn get(&mut self, index: u64) -> Result<DatasetExample, PluginCallError> {
        let call = format!("get({index})");
        if let Some(why) = &self.poisoned {
            return Err(PluginCallError {
                plugin: self.plugin.label(),
                file: self.plugin.info().file.display().to_string(),
                call,
                message: format!("instance unusable after an earlier panic: {why}"),
                panicked: false,
            });
        }
        let mut err = ErrorMessage::new();
        let mut ex = Example::empty();
        // SAFETY: the instance is open; `ex` is a valid out-pointer.
        let status = unsafe { (self.table.get)(self.inst, index, &mut ex, err.as_mut_ptr()) };
        if let Err(e) = self.plugin.check(call.clone(), status, &err) {
            if e.panicked {
                self.poisoned = Some(e.message.clone());
            }
            return Err(e);
        }
        let bad = |message: String| PluginCallError {
            plugin: self.plugin.label(),
            file: self.plugin.info().file.display().to_string(),
            call: call.clone(),
            message,
            panicked: false,
        };
        // SAFETY: the example's buffers are valid until the next call on this instance; everything is copied now.
        unsafe {
            let text = |s: &FerlStr| s.to_str().map(str::to_string).map_err(bad);
            match ex.kind {
                EXAMPLE_PROMPT_RESPONSE => Ok(DatasetExample::PromptResponse {
                    prompt: text(&ex.prompt)?,
                    response: text(&ex.response)?,
                }),
                EXAMPLE_MESSAGES_JSON => Ok(DatasetExample::MessagesJson(text(&ex.messages_json)?)),
                EXAMPLE_TOKENS => {
                    let n = ex.n_tokens;
                    if n > 0 && (ex.input_ids.is_null() || ex.loss_mask.is_null()) {
                        return Err(bad(format!(
                            "token example of {n} tokens with a null buffer"
                        )));
                    }
                    let (ids, mask) = if n == 0 {
                        (Vec::new(), Vec::new())
                    } else {
                        (
                            std::slice::from_raw_parts(ex.input_ids, n).to_vec(),
                            std::slice::from_raw_parts(ex.loss_mask, n).to_vec(),
                        )
                    };
                    Ok(DatasetExample::Tokens {
                        input_ids: ids,
                        loss_mask: mask,
                    })
                }
                k => Err(bad(format!("unknown example kind {k}"))),
            }
        }
    }
}

impl Drop for DatasetInstance {
    fn drop(&mut self) {
        let mut err = ErrorMessage::new();
        // SAFETY: the instance is open and never used again.
        let status = unsafe { (self.table.close)(self.inst, err.as_mut_ptr()) };
        if let Err(e) = self.plugin.check("close", status, &err) {
            tracing::warn!("{e}");
        }
    }
}
