//! Rewards on the host side: the [`RewardFn`] trait every reward implements (plugin-backed or written in a driver),
//! one open reward plugin ([`RewardInstance`]), the version-following wrapper a trainer keeps ([`HotReward`]) and
//! closures as rewards ([`FnReward`]).

use crate::library::{KindTable, LoadedPlugin};
use crate::registry::PluginHost;
use crate::PluginCallError;
use anyhow::{anyhow, bail, Result};
use ferl_plugin_abi::reward::{RewardItem, RewardVTable};
use ferl_plugin_abi::{ErrorMessage, FerlStr};
use std::ffi::c_void;
use std::sync::Arc;

pub use ferl_plugin_abi::reward::RewardInput;

/// The scores of a batch: one per row, plus each named extra with one value per row.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RewardScores {
    /// One reward per row.
    pub scores: Vec<f32>,
    /// `(name, one value per row)`, in the reward's order.
    pub extras: Vec<(String, Vec<f32>)>,
}

impl RewardScores {
    /// The values of extra `name`, if the reward reports it.
    pub fn extra(&self, name: &str) -> Option<&[f32]> {
        self.extras
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_slice())
    }

    /// Checks the shape against `rows` rows and that every value is finite; the error names the row and the extra.
    pub fn check(&self, rows: usize) -> Result<(), String> {
        if self.scores.len() != rows {
            return Err(format!("{rows} rows gave {} scores", self.scores.len()));
        }
        if let Some(i) = self.scores.iter().position(|v| !v.is_finite()) {
            return Err(format!("row {i}: score is {}", self.scores[i]));
        }
        for (name, values) in &self.extras {
            if values.len() != rows {
                return Err(format!(
                    "extra `{name}`: {} values for {rows} rows",
                    values.len()
                ));
            }
            if let Some(i) = values.iter().position(|v| !v.is_finite()) {
                return Err(format!("row {i}: extra `{name}` is {}", values[i]));
            }
        }
        Ok(())
    }
}

/// A reward: scores a batch of rows. Plugin-backed rewards ([`HotReward`], [`RewardInstance`]) and rewards written
/// in a driver ([`FnReward`] or a type of its own) implement it alike.
pub trait RewardFn: Send {
    /// The name errors and metrics use.
    fn name(&self) -> String;

    /// Scores `rows` (one score per row, extras optional).
    fn score(&mut self, rows: &[RewardInput<'_>]) -> Result<RewardScores>;

    /// [`RewardFn::score`], then [`RewardScores::check`]: a wrong count or a non-finite value is an error naming
    /// the reward and the row.
    fn score_checked(&mut self, rows: &[RewardInput<'_>]) -> Result<RewardScores> {
        let out = self.score(rows)?;
        out.check(rows.len())
            .map_err(|e| anyhow!("reward `{}`: {e}", self.name()))?;
        Ok(out)
    }
}

/// One open instance of a reward plugin version. After a panic inside the plugin it refuses further calls (its
/// state is unknown). Closed on drop.
pub struct RewardInstance {
    plugin: Arc<LoadedPlugin>,
    table: &'static RewardVTable,
    inst: *mut c_void,
    names: Vec<String>,
    poisoned: Option<String>,
}

// SAFETY: used by one thread at a time (`&mut self` for every call into the plugin).
unsafe impl Send for RewardInstance {}

impl RewardInstance {
    /// Opens `plugin` (a reward) with `config` and reads its extra names.
    pub fn open(plugin: Arc<LoadedPlugin>, config: &str) -> Result<Self> {
        let KindTable::Reward(table) = plugin.table else {
            bail!(
                "plugin {} is a {} plugin, not a reward",
                plugin.label(),
                plugin.info().kind.as_str()
            );
        };
        let inst = plugin.open_instance(table.open, format!("open({config})"), config)?;
        let mut me = Self {
            plugin,
            table,
            inst,
            names: Vec::new(),
            poisoned: None,
        };
        me.names = me.read_names()?;
        Ok(me)
    }

    fn read_names(&self) -> Result<Vec<String>> {
        let mut err = ErrorMessage::new();
        let (mut ptr, mut n): (*const FerlStr, usize) = (std::ptr::null(), 0);
        // SAFETY: the instance is open; out-pointers are valid.
        let status =
            unsafe { (self.table.extra_names)(self.inst, &mut ptr, &mut n, err.as_mut_ptr()) };
        self.plugin.check("extra_names", status, &err)?;
        if n > 0 && ptr.is_null() {
            bail!(
                "plugin {}: extra_names gave {n} names at a null pointer",
                self.plugin.label()
            );
        }
        let raw = if n == 0 {
            &[][..]
        } else {
            // SAFETY: the plugin keeps `n` names at `ptr` until close.
            unsafe { std::slice::from_raw_parts(ptr, n) }
        };
        let mut names: Vec<String> = Vec::with_capacity(n);
        for (j, s) in raw.iter().enumerate() {
            // SAFETY: as above.
            let name = unsafe { s.to_str() }
                .map_err(|e| anyhow!("plugin {}: extra name {j}: {e}", self.plugin.label()))?;
            if name.is_empty() || names.iter().any(|n| n == name) {
                bail!(
                    "plugin {}: extra name {j} `{name}` is empty or repeated",
                    self.plugin.label()
                );
            }
            names.push(name.to_string());
        }
        Ok(names)
    }

    /// The plugin version serving this reward.
    pub fn plugin(&self) -> &Arc<LoadedPlugin> {
        &self.plugin
    }

    /// The names of the extras each row reports.
    pub fn extra_names(&self) -> &[String] {
        &self.names
    }

    fn error(&self, call: &str, message: String) -> PluginCallError {
        PluginCallError {
            plugin: self.plugin.label(),
            file: self.plugin.info().file.display().to_string(),
            call: call.to_string(),
            message,
            panicked: false,
        }
    }

    /// Scores `rows`; the values are checked ([`RewardScores::check`]) and a bad one is an error naming the row.
    pub fn score(&mut self, rows: &[RewardInput<'_>]) -> Result<RewardScores, PluginCallError> {
        let call = format!("score({} rows)", rows.len());
        if let Some(why) = &self.poisoned {
            return Err(self.error(
                &call,
                format!("instance unusable after an earlier panic: {why}"),
            ));
        }
        let items: Vec<RewardItem> = rows
            .iter()
            .map(|r| RewardItem {
                prompt: FerlStr::new(r.prompt),
                response: FerlStr::new(r.response),
                ground_truth: FerlStr::new(r.ground_truth),
                extra_info: FerlStr::new(r.extra_info),
            })
            .collect();
        let k = self.names.len();
        let mut scores = vec![f32::NAN; rows.len()];
        let mut extras = vec![f32::NAN; rows.len() * k];
        let mut err = ErrorMessage::new();
        // SAFETY: `items` and the strings it borrows outlive the call; the buffers hold n and n*k floats.
        let status = unsafe {
            (self.table.score)(
                self.inst,
                items.as_ptr(),
                items.len(),
                scores.as_mut_ptr(),
                extras.as_mut_ptr(),
                err.as_mut_ptr(),
            )
        };
        if let Err(e) = self.plugin.check(call.clone(), status, &err) {
            if e.panicked {
                self.poisoned = Some(e.message.clone());
            }
            return Err(e);
        }
        let extras = self
            .names
            .iter()
            .enumerate()
            .map(|(j, name)| {
                (
                    name.clone(),
                    (0..rows.len()).map(|i| extras[i * k + j]).collect(),
                )
            })
            .collect();
        let out = RewardScores { scores, extras };
        out.check(rows.len()).map_err(|m| self.error(&call, m))?;
        Ok(out)
    }
}

impl RewardFn for RewardInstance {
    fn name(&self) -> String {
        self.plugin.info().name.clone()
    }

    fn score(&mut self, rows: &[RewardInput<'_>]) -> Result<RewardScores> {
        Ok(RewardInstance::score(self, rows)?)
    }
}

impl Drop for RewardInstance {
    fn drop(&mut self) {
        let mut err = ErrorMessage::new();
        // SAFETY: the instance is open and never used again.
        let status = unsafe { (self.table.close)(self.inst, err.as_mut_ptr()) };
        if let Err(e) = self.plugin.check("close", status, &err) {
            tracing::warn!("{e}");
        }
    }
}

/// A reward chosen by name that follows the host's current version of that plugin: each `score` call (a step
/// boundary) switches to a newly loaded version. After a panic the instance is dropped and the next call opens a
/// fresh one.
pub struct HotReward {
    host: Arc<PluginHost>,
    name: String,
    config: String,
    current: Option<(u64, RewardInstance)>,
}

impl HotReward {
    /// A reward following plugin `name` of `host`, opened with `config`. Fails when no such reward is loaded or it
    /// does not open.
    pub fn new(host: Arc<PluginHost>, name: &str, config: &str) -> Result<Self> {
        let mut me = Self {
            host,
            name: name.to_string(),
            config: config.to_string(),
            current: None,
        };
        me.ensure_current()?;
        Ok(me)
    }

    /// The plugin version in use.
    pub fn version(&self) -> Option<String> {
        self.current
            .as_ref()
            .map(|(_, i)| i.plugin().info().version.clone())
    }

    fn ensure_current(&mut self) -> Result<&mut RewardInstance> {
        // Checks the kind first: its error lists the rewards that are loaded.
        self.host
            .get_kind(&self.name, ferl_plugin_abi::PluginKind::Reward)?;
        let (generation, plugin) = self
            .host
            .current(&self.name)
            .ok_or_else(|| anyhow!("reward plugin `{}` is no longer loaded", self.name))?;
        if self.current.as_ref().is_none_or(|(g, _)| *g != generation) {
            self.current = None; // closes the old instance, letting its library unload
            self.current = Some((generation, RewardInstance::open(plugin, &self.config)?));
        }
        Ok(&mut self.current.as_mut().expect("just opened").1)
    }
}

impl RewardFn for HotReward {
    fn name(&self) -> String {
        self.name.clone()
    }

    fn score(&mut self, rows: &[RewardInput<'_>]) -> Result<RewardScores> {
        let result = self.ensure_current()?.score(rows);
        if matches!(&result, Err(e) if e.panicked) {
            self.current = None;
        }
        Ok(result?)
    }
}

/// A reward written in a driver as a closure scoring one row (no extras); an error names the row.
pub struct FnReward<F> {
    name: String,
    f: F,
}

impl<F> FnReward<F>
where
    F: FnMut(&RewardInput<'_>) -> Result<f32> + Send,
{
    /// The reward `name` computed by `f`.
    pub fn new(name: &str, f: F) -> Self {
        Self {
            name: name.to_string(),
            f,
        }
    }
}

impl<F> RewardFn for FnReward<F>
where
    F: FnMut(&RewardInput<'_>) -> Result<f32> + Send,
{
    fn name(&self) -> String {
        self.name.clone()
    }

    fn score(&mut self, rows: &[RewardInput<'_>]) -> Result<RewardScores> {
        let scores = rows
            .iter()
            .enumerate()
            .map(|(i, r)| {
                (self.f)(r).map_err(|e| anyhow!("reward `{}`: row {i}: {e:#}", self.name))
            })
            .collect::<Result<_>>()?;
        Ok(RewardScores {
            scores,
            extras: Vec::new(),
        })
    }
}
