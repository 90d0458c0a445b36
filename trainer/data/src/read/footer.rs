//! A check of a parquet file's footer before the parquet crate reads it. That crate (56) sizes vectors by the element
//! counts the footer's thrift lists announce, before reading them: a corrupt count of billions aborts the process
//! on a failed allocation (found by fuzzing, `fuzz/corpus/data-parquet/err-footer-list-of-billions`). This walks the
//! footer's thrift compact encoding once and refuses any list, set, map or string announcing more elements than
//! bytes are left, or nesting deeper than thrift's own limit.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};

use anyhow::{bail, Result};

const MAGIC: &[u8] = b"PAR1";
/// Thrift's default nesting limit.
const MAX_DEPTH: usize = 64;

/// Checks the footer of the parquet file `file` (reads only the footer).
pub(super) fn check_file(file: &mut File) -> Result<()> {
    let size = file.metadata()?.len();
    if size < 8 {
        return Ok(());
    }
    let mut tail = [0u8; 8];
    file.seek(SeekFrom::Start(size - 8))?;
    file.read_exact(&mut tail)?;
    let len = u64::from(u32::from_le_bytes(tail[..4].try_into().expect("4 bytes")));
    let mut footer = vec![0u8; len.min(size - 8) as usize];
    file.seek(SeekFrom::Start(size - 8 - footer.len() as u64))?;
    file.read_exact(&mut footer)?;
    footer.extend_from_slice(&tail);
    file.rewind()?;
    if len > size - 8 && &tail[4..] == MAGIC {
        bail!("the footer claims {len} bytes, more than the file holds");
    }
    check(&footer)
}

/// Checks the footer at the end of `bytes` (bytes not ending in `PAR1` are left to the parquet reader, which refuses
/// them with its own message).
fn check(bytes: &[u8]) -> Result<()> {
    let Some(tail) = bytes.len().checked_sub(8).map(|at| &bytes[at..]) else {
        return Ok(());
    };
    if &tail[4..] != MAGIC {
        return Ok(());
    }
    let len = u32::from_le_bytes(tail[..4].try_into().expect("4 bytes")) as usize;
    let Some(start) = (bytes.len() - 8).checked_sub(len) else {
        bail!("the footer claims {len} bytes, more than the file holds");
    };
    let mut walker = Walker {
        bytes: &bytes[start..bytes.len() - 8],
        at: 0,
    };
    walker.strukt(0)?;
    super::bounded::check(&bytes[start..bytes.len() - 8])
}

struct Walker<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl Walker<'_> {
    fn left(&self) -> usize {
        self.bytes.len() - self.at
    }

    fn byte(&mut self) -> Result<u8> {
        let Some(&b) = self.bytes.get(self.at) else {
            bail!("the footer ends in the middle of a value");
        };
        self.at += 1;
        Ok(b)
    }

    fn varint(&mut self) -> Result<u64> {
        let mut value = 0u64;
        for shift in (0..64).step_by(7) {
            let b = self.byte()?;
            value |= u64::from(b & 0x7f) << shift;
            if b & 0x80 == 0 {
                return Ok(value);
            }
        }
        bail!("the footer holds a varint longer than 64 bits")
    }

    /// A count of `min_size`-byte elements that must fit in what is left (and in an i32, as the reader casts it).
    fn count(&mut self, count: u64, min_size: usize, what: &str) -> Result<usize> {
        let fits = usize::try_from(count)
            .ok()
            .and_then(|n| n.checked_mul(min_size))
            .is_some_and(|bytes| bytes <= self.left());
        if !fits || count > i32::MAX as u64 {
            bail!(
                "the footer announces a {what} of {count} elements with {} bytes left",
                self.left()
            );
        }
        Ok(count as usize)
    }

    fn strukt(&mut self, depth: usize) -> Result<()> {
        if depth > MAX_DEPTH {
            bail!("the footer nests values more than {MAX_DEPTH} deep");
        }
        loop {
            let header = self.byte()?;
            if header == 0 {
                return Ok(());
            }
            if header >> 4 == 0 {
                self.varint()?; // the field id, when not a delta
            }
            match header & 0x0f {
                1 | 2 => {} // booleans live in the field header
                kind => self.value(kind, depth + 1)?,
            }
        }
    }

    fn value(&mut self, kind: u8, depth: usize) -> Result<()> {
        match kind {
            1..=3 => drop(self.byte()?),
            4..=6 => drop(self.varint()?),
            7 => self.skip(8)?,
            8 => {
                let len = self.varint()?;
                let len = self.count(len, 1, "string")?;
                self.skip(len)?;
            }
            9 | 10 => self.list(depth)?,
            11 => self.map(depth)?,
            12 => self.strukt(depth)?,
            other => bail!("the footer holds a value of unknown thrift type {other}"),
        }
        Ok(())
    }

    fn skip(&mut self, n: usize) -> Result<()> {
        if n > self.left() {
            bail!("the footer ends in the middle of a value");
        }
        self.at += n;
        Ok(())
    }

    fn list(&mut self, depth: usize) -> Result<()> {
        let header = self.byte()?;
        let short = u64::from(header >> 4);
        let count = if short == 15 { self.varint()? } else { short };
        let count = self.count(count, 1, "list")?;
        for _ in 0..count {
            self.value(header & 0x0f, depth)?;
        }
        Ok(())
    }

    fn map(&mut self, depth: usize) -> Result<()> {
        let count = self.varint()?;
        let count = self.count(count, 2, "map")?;
        if count == 0 {
            return Ok(());
        }
        let kinds = self.byte()?;
        for _ in 0..count {
            self.value(kinds >> 4, depth)?;
            self.value(kinds & 0x0f, depth)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(footer: &[u8]) -> Vec<u8> {
        let mut out = b"PAR1".to_vec();
        out.extend_from_slice(footer);
        out.extend_from_slice(&(footer.len() as u32).to_le_bytes());
        out.extend_from_slice(MAGIC);
        out
    }

    #[test]
    fn counts_beyond_the_footer_are_refused() {
        // Field 1, a list of structs announcing 2^28 - 1 of them.
        let err = check(&file(&[0x19, 0xfc, 0xff, 0xff, 0xff, 0x7f, 0x00])).unwrap_err();
        assert!(
            err.to_string()
                .contains("a list of 268435455 elements with 1 bytes left"),
            "{err}"
        );
        let err = check(&file(&[0x18, 0x85, 0x01, b'x', 0x00])).unwrap_err();
        assert!(
            err.to_string().contains("a string of 133 elements"),
            "{err}"
        );
        // Field 1 = i32 5, field 2 = a list of two strings, end: well formed thrift (not a whole FileMetaData).
        let bytes = [0x15, 0x0a, 0x19, 0x28, 0x01, b'a', 0x01, b'b', 0x00];
        Walker {
            bytes: &bytes,
            at: 0,
        }
        .strukt(0)
        .unwrap();
    }

    #[test]
    fn a_field_of_the_wrong_type_read_as_a_list_is_refused() {
        // Field 4 (`row_groups`, a list) sent as an i32 varint: the walker skips a varint, parquet's generated code
        // reads the same bytes as a list header announcing 2^24 - 1 row groups.
        let footer = [0x45, 0xfc, 0xff, 0xff, 0xff, 0x07, 0x00];
        Walker {
            bytes: &footer,
            at: 0,
        }
        .strukt(0)
        .unwrap();
        let err = check(&file(&footer)).unwrap_err();
        assert!(
            err.to_string()
                .contains("a list of 16777215 elements with 1 bytes left"),
            "{err}"
        );
    }
}
