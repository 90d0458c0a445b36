//! `ferl plugin list|reload`: what a running job has loaded, and asking it to reload a plugin.
//!
//! A job talks through its run directory (`trainer.default_local_dir`): it keeps `plugins/state.json` current and
//! takes reload requests from `plugins/requests/` at each step boundary (see `ferl_plugin_host::control`).

use anyhow::{bail, Result};
use clap::{Args, Subcommand};
use ferl_plugin_host::control::ControlDir;
use ferl_plugin_host::registry::inspect_dir;
use std::path::PathBuf;
use std::time::Duration;

/// `ferl plugin` subcommands.
#[derive(Subcommand)]
pub(crate) enum PluginCommand {
    /// Show the plugins a running job has loaded (`--run-dir`) or the plugin files of a folder (`--dir`).
    List(ListArgs),
    /// Ask a running job to load plugin NAME again from its file; it switches at the next step boundary.
    Reload(ReloadArgs),
}

/// Options of `ferl plugin list`.
#[derive(Args)]
pub(crate) struct ListArgs {
    /// The job's run directory (`trainer.default_local_dir`).
    #[arg(long, env = "FERL_RUN_DIR", conflicts_with = "dir")]
    run_dir: Option<PathBuf>,
    /// A plugins folder: load each library in it and show its manifest or why it is refused.
    #[arg(long)]
    dir: Option<PathBuf>,
}

/// Options of `ferl plugin reload`.
#[derive(Args)]
pub(crate) struct ReloadArgs {
    /// The plugin's name (as `ferl plugin list` shows it).
    name: String,
    /// The job's run directory (`trainer.default_local_dir`).
    #[arg(long, env = "FERL_RUN_DIR")]
    run_dir: PathBuf,
    /// How long to wait for the job's answer (it answers at its next step boundary).
    #[arg(long, default_value_t = 300)]
    timeout_s: u64,
}

/// Runs a `ferl plugin` subcommand.
pub(crate) fn run(c: PluginCommand) -> Result<()> {
    match c {
        PluginCommand::List(a) => list(a),
        PluginCommand::Reload(a) => reload(a),
    }
}

fn list(a: ListArgs) -> Result<()> {
    if let Some(dir) = a.dir {
        println!("{:<16} {:<8} {:<10} FILE", "NAME", "KIND", "VERSION");
        for (file, info) in inspect_dir(&dir)? {
            match info {
                Ok(i) => println!(
                    "{:<16} {:<8} {:<10} {}",
                    i.name,
                    i.kind.as_str(),
                    i.version,
                    file.display()
                ),
                Err(e) => println!(
                    "{:<16} {:<8} {:<10} {} (refused: {e:#})",
                    "-",
                    "-",
                    "-",
                    file.display()
                ),
            }
        }
        return Ok(());
    }
    let Some(run_dir) = a.run_dir else {
        bail!("give --run-dir RUN_DIR (a running job's trainer.default_local_dir) or --dir PLUGINS_FOLDER");
    };
    let rows = ControlDir::new(&run_dir).read_state()?;
    println!(
        "{:<16} {:<8} {:<10} {:<8} FILE",
        "NAME", "KIND", "VERSION", "STATE"
    );
    for r in rows {
        println!(
            "{:<16} {:<8} {:<10} {:<8} {}",
            r.name, r.kind, r.version, r.state, r.file
        );
        if let Some(e) = r.last_error {
            println!("    last reload failed: {e}");
        }
    }
    Ok(())
}

fn reload(a: ReloadArgs) -> Result<()> {
    let control = ControlDir::new(&a.run_dir);
    let id = control.submit_reload(&a.name)?;
    let r = match control.wait_response(&id, Duration::from_secs(a.timeout_s)) {
        Ok(r) => r,
        Err(e) => {
            // Take the unanswered request back: left in the folder, it would be served by the next job started in
            // this run directory (a resumed run), reloading a plugin nobody asked that job to reload.
            let pending = control
                .root()
                .join("requests")
                .join(format!("{id}.request"));
            let _ = std::fs::remove_file(pending);
            return Err(e);
        }
    };
    if !r.ok {
        bail!("reload of `{}` refused: {}", a.name, r.message);
    }
    println!("{}", r.message);
    Ok(())
}
