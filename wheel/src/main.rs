//! The `ferl` a pip-installed wheel puts on PATH. The real binary links libtorch, which the wheel does not carry: it
//! comes from the `torch==2.11.0` package the wheel depends on. So this launcher asks the environment's Python where
//! that package is (`importlib`, without importing torch), puts its `lib/` first on `LD_LIBRARY_PATH`, and replaces
//! itself with `<prefix>/lib/ferl/ferl`. No path is baked in: torch may be installed anywhere Python finds it.

use std::ffi::OsString;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

/// The torch release whose C++ ABI the binary was built against.
const TORCH_RELEASE: &str = "2.11.0";

/// Asks Python for torch's version and library folder, one per line, without importing torch.
const FIND_TORCH: &str = "import importlib.util as u, importlib.metadata as m, os\n\
s = u.find_spec('torch')\n\
print(m.version('torch') if s else '')\n\
print(os.path.join(os.path.dirname(s.origin), 'lib') if s else '')\n";

fn main() -> ExitCode {
    match launch() {
        Ok(never) => match never {},
        Err(message) => {
            eprintln!("ferl: {message}");
            ExitCode::from(2)
        }
    }
}

/// Finds the binary and libtorch, then execs; returns only with a message saying what is missing.
fn launch() -> Result<std::convert::Infallible, String> {
    let exe = std::env::current_exe()
        .and_then(|p| p.canonicalize())
        .map_err(|e| format!("cannot locate this launcher: {e}"))?;
    let scripts = exe.parent().ok_or("the launcher has no folder")?;
    let prefix = scripts
        .parent()
        .ok_or("the launcher's folder has no parent")?;
    let binary = prefix.join("lib/ferl/ferl");
    if !binary.is_file() {
        return Err(format!(
            "{} is missing: reinstall the wheel (`pip install --force-reinstall ferl`)",
            binary.display()
        ));
    }
    let torch_lib = torch_lib(&python(scripts))?;
    let library_path = prepend(&torch_lib, std::env::var_os("LD_LIBRARY_PATH"));
    let err = Command::new(&binary)
        .arg0("ferl")
        .args(std::env::args_os().skip(1))
        .env("LD_LIBRARY_PATH", library_path)
        .env("FERL_TORCH_LIB", &torch_lib)
        .exec();
    Err(format!("cannot start {}: {err}", binary.display()))
}

/// The Python of this environment: `FERL_PYTHON`, else the interpreter beside the launcher (a venv's or a prefix's
/// `bin/`), else `python3` on PATH.
fn python(scripts: &Path) -> PathBuf {
    if let Some(p) = std::env::var_os("FERL_PYTHON") {
        return PathBuf::from(p);
    }
    ["python3", "python"]
        .iter()
        .map(|name| scripts.join(name))
        .find(|p| p.is_file())
        .unwrap_or_else(|| PathBuf::from("python3"))
}

/// torch's `lib/` folder as `python` finds it, checked to be release [`TORCH_RELEASE`] and to hold libtorch.
fn torch_lib(python: &Path) -> Result<PathBuf, String> {
    let out = Command::new(python)
        .args(["-c", FIND_TORCH])
        .output()
        .map_err(|e| {
            format!(
                "cannot run {} to find torch: {e} (set FERL_PYTHON)",
                python.display()
            )
        })?;
    if !out.status.success() {
        let stderr = String::from_utf8_lossy(&out.stderr);
        return Err(format!(
            "{} could not look for torch: {}",
            python.display(),
            stderr.trim()
        ));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let mut lines = text.lines();
    let (version, lib) = (lines.next().unwrap_or(""), lines.next().unwrap_or(""));
    if version.is_empty() {
        return Err(format!(
            "torch is not installed for {}: `pip install torch=={TORCH_RELEASE}`",
            python.display()
        ));
    }
    // Local builds add a suffix (`2.11.0+cpu`); the release must match exactly for the C++ ABI.
    if version.split('+').next() != Some(TORCH_RELEASE) {
        return Err(format!(
            "ferl needs torch=={TORCH_RELEASE}, but {} has torch {version}: `pip install torch=={TORCH_RELEASE}`",
            python.display()
        ));
    }
    let lib = PathBuf::from(lib);
    if !lib.join("libtorch_cpu.so").is_file() {
        return Err(format!(
            "torch {version} has no libtorch_cpu.so under {}",
            lib.display()
        ));
    }
    Ok(lib)
}

/// `dir` first, then what `LD_LIBRARY_PATH` already held.
fn prepend(dir: &Path, existing: Option<OsString>) -> OsString {
    let mut path = OsString::from(dir);
    if let Some(rest) = existing.filter(|r| !r.is_empty()) {
        path.push(":");
        path.push(rest);
    }
    path
}
