//! Loading one plugin file: private copy, `dlopen`, manifest and ABI checks, kind table lookup, unload on drop.

use crate::PluginCallError;
use anyhow::{anyhow, bail, Context, Result};
use ferl_plugin_abi::dataset::DatasetVTable;
use ferl_plugin_abi::kernel::KernelVTable;
use ferl_plugin_abi::logger::LoggerVTable;
use ferl_plugin_abi::reward::RewardVTable;
use ferl_plugin_abi::{
    ErrorMessage, FerlStr, Manifest, ManifestFn, PluginKind, FERL_PLUGIN_ABI_VERSION,
    MANIFEST_SYMBOL, STATUS_OK, STATUS_PANIC,
};
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// What a plugin says about itself, copied out of its manifest, plus where it came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PluginInfo {
    /// The manifest's name.
    pub name: String,
    /// The manifest's kind.
    pub kind: PluginKind,
    /// The manifest's version.
    pub version: String,
    /// The manifest's description.
    pub description: String,
    /// The file it was loaded from (`builtin:NAME` for a built-in).
    pub file: PathBuf,
    /// SHA-256 of the file's bytes (hex), empty for a built-in.
    pub sha256: String,
}

/// The kind table of a loaded plugin (copied by value; its function pointers live as long as the library).
pub(crate) enum KindTable {
    Dataset(&'static DatasetVTable),
    Logger(&'static LoggerVTable),
    Kernel(&'static KernelVTable),
    Reward(&'static RewardVTable),
}

/// One version of one plugin, loaded from its own copy of the file. Unloaded (and the copy deleted) on drop.
pub struct LoadedPlugin {
    info: PluginInfo,
    pub(crate) table: KindTable,
    copy: Option<PathBuf>,
    // Declared last on purpose and dropped explicitly in `Drop`: the tables above point into it.
    library: Option<libloading::Library>,
}

static COPY_COUNTER: AtomicU64 = AtomicU64::new(0);

/// SHA-256 (hex) of `bytes`.
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

impl LoadedPlugin {
    /// Loads `file` from a private copy under `copies_dir`, checks its manifest (ABI version, kind, table symbol) and,
    /// when `expect` is given, that it is of that kind. Errors name the file and the problem.
    pub fn load(file: &Path, copies_dir: &Path, expect: Option<PluginKind>) -> Result<Self> {
        let bytes = std::fs::read(file)
            .with_context(|| format!("cannot read plugin file {}", file.display()))?;
        let sha256 = sha256_hex(&bytes);
        std::fs::create_dir_all(copies_dir).with_context(|| {
            format!(
                "cannot create the plugin copies folder {}",
                copies_dir.display()
            )
        })?;
        let stem = file
            .file_stem()
            .and_then(|s| s.to_str())
            .unwrap_or("plugin");
        let ext = file.extension().and_then(|s| s.to_str()).unwrap_or("so");
        let copy = copies_dir.join(format!(
            "{stem}-{}-{}-{}.{ext}",
            &sha256[..12],
            std::process::id(),
            COPY_COUNTER.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::write(&copy, &bytes).with_context(|| {
            format!(
                "cannot copy plugin {} to {}",
                file.display(),
                copy.display()
            )
        })?;
        match Self::open_copy(file, &copy, sha256, expect) {
            Ok(p) => Ok(p),
            Err(e) => {
                let _ = std::fs::remove_file(&copy);
                Err(e)
            }
        }
    }

    fn open_copy(
        file: &Path,
        copy: &Path,
        sha256: String,
        expect: Option<PluginKind>,
    ) -> Result<Self> {
        let shown = file.display();
        // SAFETY: loading a library runs its initialisers; plugins are trusted code the user chose to load.
        let library = unsafe { libloading::Library::new(copy) }.map_err(|e| {
            anyhow!(
                "plugin {shown}: cannot load the library: {}",
                dl_reason(&e, copy, file)
            )
        })?;
        let declared = read_manifest(&library, &shown, expect)?;
        let table = load_kind_table(&library, declared.kind, &shown)?;
        let info = PluginInfo {
            name: declared.name,
            kind: declared.kind,
            version: declared.version,
            description: declared.description,
            file: file.to_path_buf(),
            sha256,
        };
        Ok(Self {
            info,
            table,
            copy: Some(copy.to_path_buf()),
            library: Some(library),
        })
    }

    /// A kernel plugin compiled into the host (no file): `ferl-kernels`' table served without `dlopen`.
    pub fn builtin_kernel(
        name: &str,
        version: &str,
        description: &str,
        table: &'static KernelVTable,
    ) -> Result<Self> {
        check_kernel_ops(&format!("builtin:{name}"), table)?;
        Ok(Self {
            info: PluginInfo {
                name: name.to_string(),
                kind: PluginKind::Kernel,
                version: version.to_string(),
                description: description.to_string(),
                file: PathBuf::from(format!("builtin:{name}")),
                sha256: String::new(),
            },
            table: KindTable::Kernel(table),
            copy: None,
            library: None,
        })
    }

    /// Name, kind, version and source file.
    pub fn info(&self) -> &PluginInfo {
        &self.info
    }

    /// The private copy this version runs from (`None` for a built-in).
    pub fn copy_path(&self) -> Option<&Path> {
        self.copy.as_deref()
    }

    /// `name@version`, as errors show it.
    pub fn label(&self) -> String {
        format!("{}@{}", self.info.name, self.info.version)
    }

    /// Turns a non-OK status of call `call` into a [`PluginCallError`].
    pub(crate) fn call_error(
        &self,
        call: impl Into<String>,
        status: i32,
        err: &ErrorMessage,
    ) -> PluginCallError {
        PluginCallError {
            plugin: self.label(),
            file: self.info.file.display().to_string(),
            call: call.into(),
            message: err.message(),
            panicked: status == STATUS_PANIC,
        }
    }

    /// Opens an instance with `config` through a table's `open` (the same signature in every kind), checking the
    /// status (`call` names it in errors) and refusing a null instance.
    pub(crate) fn open_instance(
        &self,
        open: OpenFn,
        call: impl Into<String>,
        config: &str,
    ) -> anyhow::Result<*mut std::ffi::c_void> {
        let mut err = ErrorMessage::new();
        let mut inst: *mut std::ffi::c_void = std::ptr::null_mut();
        // SAFETY: `config` outlives the call; `inst` and `err` are valid out-pointers.
        let status = unsafe { open(FerlStr::new(config), &mut inst, err.as_mut_ptr()) };
        self.check(call, status, &err)?;
        if inst.is_null() {
            bail!("plugin {}: open returned no instance", self.label());
        }
        Ok(inst)
    }

    /// `Ok` for [`STATUS_OK`], else the call's error.
    pub(crate) fn check(
        &self,
        call: impl Into<String>,
        status: i32,
        err: &ErrorMessage,
    ) -> Result<(), PluginCallError> {
        if status == STATUS_OK {
            Ok(())
        } else {
            Err(self.call_error(call, status, err))
        }
    }
}

/// What a plugin's manifest declares, copied out of the library.
struct DeclaredManifest {
    name: String,
    kind: PluginKind,
    version: String,
    description: String,
}

/// Calls `library`'s manifest function and checks the manifest: ABI version, size, UTF-8 strings, a non-empty name,
/// a known kind and, when `expect` is given, that kind. Errors name the file (`shown`) and the problem.
fn read_manifest(
    library: &libloading::Library,
    shown: &std::path::Display<'_>,
    expect: Option<PluginKind>,
) -> Result<DeclaredManifest> {
    // SAFETY: `MANIFEST_SYMBOL` is declared by the ABI as a `ManifestFn`; copying the function pointer out of the
    // `Symbol` is fine because it is only called below, while `library` (borrowed for this whole function) is loaded.
    let manifest_fn: ManifestFn = unsafe {
        *library.get::<ManifestFn>(MANIFEST_SYMBOL.as_bytes()).map_err(|_| {
            anyhow!("plugin {shown}: missing symbol `{MANIFEST_SYMBOL}` (not a ferl plugin, or not exported with ferl_plugin_abi's export macros)")
        })?
    };
    // SAFETY: the symbol has the manifest signature by the ABI contract; the result is checked for null and size.
    let manifest: &Manifest = unsafe { manifest_fn().as_ref() }
        .ok_or_else(|| anyhow!("plugin {shown}: `{MANIFEST_SYMBOL}` returned null"))?;
    if manifest.abi_version != FERL_PLUGIN_ABI_VERSION {
        bail!(
            "plugin {shown}: built against plugin ABI version {}, but this host speaks version {FERL_PLUGIN_ABI_VERSION}; rebuild it against ferl-plugin-abi {FERL_PLUGIN_ABI_VERSION}",
            manifest.abi_version
        );
    }
    if manifest.struct_size < std::mem::size_of::<Manifest>() {
        bail!(
            "plugin {shown}: manifest is {} bytes, expected at least {}",
            manifest.struct_size,
            std::mem::size_of::<Manifest>()
        );
    }
    let text = |s: &ferl_plugin_abi::FerlStr, what: &str| -> Result<String> {
        // SAFETY: manifest strings point to 'static data of the loaded library.
        unsafe { s.to_str() }
            .map(str::to_string)
            .map_err(|e| anyhow!("plugin {shown}: manifest {what}: {e}"))
    };
    let name = text(&manifest.name, "name")?;
    if name.is_empty() {
        bail!("plugin {shown}: manifest has an empty name");
    }
    let version = text(&manifest.version, "version")?;
    let description = text(&manifest.description, "description")?;
    let kind = PluginKind::from_raw(manifest.kind)
        .ok_or_else(|| anyhow!("plugin {shown}: manifest names unknown kind {} (known: 1 dataset, 2 logger, 3 kernel, 4 reward)", manifest.kind))?;
    if let Some(want) = expect {
        if want != kind {
            bail!(
                "plugin {shown}: manifest of `{name}` says kind {}, but a {} plugin was expected",
                kind.as_str(),
                want.as_str()
            );
        }
    }
    Ok(DeclaredManifest {
        name,
        kind,
        version,
        description,
    })
}

/// Looks up and checks the table of `kind` in `library` (a kernel table's op names too).
///
/// The returned table points into `library`: the caller must keep the library loaded while it is used (a
/// [`LoadedPlugin`] stores both and unloads last).
fn load_kind_table(
    library: &libloading::Library,
    kind: PluginKind,
    shown: &std::path::Display<'_>,
) -> Result<KindTable> {
    let symbol = kind.table_symbol();
    let missing = || {
        anyhow!(
            "plugin {shown}: manifest declares a {} plugin but the symbol `{symbol}` is missing",
            kind.as_str()
        )
    };
    // SAFETY: each kind's table symbol has the signature `load_table` is asked for; the tables live as long as
    // `library`, which the caller keeps loaded while it uses them (see above).
    let table = unsafe {
        match kind {
            PluginKind::Dataset => KindTable::Dataset(load_table::<DatasetVTable>(
                library,
                symbol,
                shown,
                |t| t.struct_size,
                &missing,
            )?),
            PluginKind::Logger => KindTable::Logger(load_table::<LoggerVTable>(
                library,
                symbol,
                shown,
                |t| t.struct_size,
                &missing,
            )?),
            PluginKind::Kernel => {
                let t = load_table::<KernelVTable>(
                    library,
                    symbol,
                    shown,
                    |t| t.struct_size,
                    &missing,
                )?;
                check_kernel_ops(&shown.to_string(), t)?;
                KindTable::Kernel(t)
            }
            PluginKind::Reward => KindTable::Reward(load_table::<RewardVTable>(
                library,
                symbol,
                shown,
                |t| t.struct_size,
                &missing,
            )?),
        }
    };
    Ok(table)
}

/// The `open` function of every instance kind's table (dataset, logger, reward).
pub(crate) type OpenFn = unsafe extern "C" fn(
    config: FerlStr,
    out: *mut *mut std::ffi::c_void,
    err: *mut ferl_plugin_abi::ErrorBuf,
) -> i32;

/// Calls the table function `symbol` of `library` and checks its answer: not null, and at least as large as this
/// host's `T` (`struct_size` reads the size the plugin declares in the table).
///
/// # Safety
/// `symbol` must be an `extern "C" fn() -> *const T` of the ABI, and `library` must stay loaded while the returned
/// table is used.
unsafe fn load_table<T>(
    library: &libloading::Library,
    symbol: &str,
    shown: &std::path::Display<'_>,
    struct_size: fn(&T) -> usize,
    missing: &dyn Fn() -> anyhow::Error,
) -> Result<&'static T> {
    // SAFETY: the caller guarantees `symbol` is an `extern "C" fn() -> *const T`, so calling it is sound; the pointer
    // it returns is checked for null before `as_ref`, and it points to a table in `library`'s static data, which the
    // caller keeps loaded while the `'static` reference is used.
    unsafe {
        let f = *library
            .get::<unsafe extern "C" fn() -> *const T>(symbol.as_bytes())
            .map_err(|_| missing())?;
        let t = f()
            .as_ref()
            .ok_or_else(|| anyhow!("plugin {shown}: `{symbol}` returned null"))?;
        check_size(
            shown.to_string(),
            symbol,
            struct_size(t),
            std::mem::size_of::<T>(),
        )?;
        Ok(&*(t as *const T))
    }
}

fn check_size(file: String, symbol: &str, got: usize, want: usize) -> Result<()> {
    if got < want {
        bail!("plugin {file}: table `{symbol}` is {got} bytes, expected at least {want} (built against an older ABI?)");
    }
    Ok(())
}

fn check_kernel_ops(file: &str, table: &KernelVTable) -> Result<()> {
    // SAFETY: `table` is a table `load_table` just returned (its library is loaded) or a built-in `'static` table;
    // either way its `n_ops` ops and their names are readable here.
    unsafe {
        for op in table.ops() {
            op.name
                .to_str()
                .map_err(|e| anyhow!("plugin {file}: kernel op name: {e}"))?;
        }
    }
    Ok(())
}

impl Drop for LoadedPlugin {
    fn drop(&mut self) {
        if let Some(lib) = self.library.take() {
            if let Err(e) = lib.close() {
                tracing::warn!(plugin = %self.label(), "unloading the plugin library failed: {e}");
            } else {
                tracing::debug!(plugin = %self.label(), "plugin library unloaded");
            }
        }
        if let Some(copy) = &self.copy {
            let _ = std::fs::remove_file(copy);
        }
    }
}

/// Why `dlopen` failed (the loader's own text, e.g. "invalid ELF header"), naming the user's file rather than the
/// private copy that was opened.
fn dl_reason(e: &libloading::Error, copy: &Path, file: &Path) -> String {
    match std::error::Error::source(e) {
        Some(why) => {
            format!("{e}: {why}").replace(&copy.display().to_string(), &file.display().to_string())
        }
        None => e.to_string(),
    }
}
