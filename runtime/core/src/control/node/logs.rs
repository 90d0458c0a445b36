//! A node agent serves its own logs folder over the control plane (`ferl logs --node NAME`, `ferl logs --actor ID`):
//! the names and sizes of its files ([`ListLogs`]), and a piece of one from a byte offset ([`ReadLog`]). Only plain
//! names of regular files directly in the folder are read (no path, no link); the node's secrets live elsewhere
//! (guarantee 7).

use std::io::{Read, Seek, SeekFrom};
use std::path::Path;

use anyhow::{bail, Context as _, Result};

use super::NodeAgent;
use crate::actor::{Context, Handler};
use crate::protocol::{ListLogs, LogChunk, ReadLog};

/// Most bytes of a log one [`LogChunk`] carries.
const LOG_CHUNK: u64 = 1 << 20;

/// Reads the file at `path` from `offset` (at most 1 MiB); `ended` says its writer had ended before the read, so
/// that reaching the end finishes it.
pub(crate) fn read_log(path: &Path, ended: bool, offset: u64) -> Result<LogChunk> {
    let mut file =
        std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let len = file.metadata()?.len();
    let offset = offset.min(len);
    file.seek(SeekFrom::Start(offset))?;
    let mut data = Vec::new();
    file.take(LOG_CHUNK).read_to_end(&mut data)?;
    let next_offset = offset + data.len() as u64;
    Ok(LogChunk {
        data,
        next_offset,
        finished: ended && next_offset >= len,
    })
}

impl NodeAgent {
    /// The regular files of the logs folder, by name, with their sizes.
    fn log_files(&self) -> Result<Vec<(String, u64)>> {
        let dir = &self.0.log_dir;
        let mut files = Vec::new();
        for entry in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
            let entry = entry?;
            let meta = entry.metadata()?;
            if let (true, Some(name)) = (meta.is_file(), entry.file_name().to_str()) {
                files.push((name.to_string(), meta.len()));
            }
        }
        files.sort();
        Ok(files)
    }
}

impl Handler<ListLogs> for NodeAgent {
    async fn handle(&self, _: ListLogs, _: &Context) -> Result<Vec<(String, u64)>> {
        self.log_files()
    }
}

impl Handler<ReadLog> for NodeAgent {
    async fn handle(&self, m: ReadLog, _: &Context) -> Result<LogChunk> {
        let name = self.0.name.as_str();
        let plain = !m.file.is_empty() && !m.file.contains('/') && m.file != "." && m.file != "..";
        let path = self.0.log_dir.join(&m.file);
        // symlink_metadata: a link is not followed out of the folder.
        if !plain || !std::fs::symlink_metadata(&path).is_ok_and(|md| md.is_file()) {
            let files: Vec<String> = self.log_files()?.into_iter().map(|(f, _)| f).collect();
            bail!(
                "no log `{}` on {name} (its logs: {})",
                m.file,
                files.join(", ")
            );
        }
        // A worker log is finished once no running worker of this node writes it; other files never are.
        let written = self
            .0
            .workers
            .lock()
            .expect("workers lock")
            .values()
            .any(|w| w.log == path);
        let ended = m.file.starts_with("worker-") && !written;
        read_log(&path, ended, m.offset)
    }
}
