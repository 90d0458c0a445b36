//! A second check of a parquet footer: parsing it with the parquet crate's own generated thrift code, through a
//! protocol that refuses any list, set or map announcing more elements than bytes are left. The generated code reads
//! each field by its id with the type it expects, ignoring the type on the wire, so a field of the wrong type can be
//! read as a list header made of arbitrary bytes: a count of billions the walker of `footer` never sees (found by
//! fuzzing, `fuzz/corpus/data-parquet/err-footer-field-of-the-wrong-type`). Where this parse is refused, the file is;
//! where it succeeds, the parquet crate's own parse of the same bytes allocates no more than the footer's size allows.

use std::cell::Cell;
use std::io::Read;
use std::rc::Rc;

use anyhow::{anyhow, Result};
use parquet::thrift::TSerializable;
use thrift::protocol::{
    TCompactInputProtocol, TFieldIdentifier, TInputProtocol, TListIdentifier, TMapIdentifier,
    TMessageIdentifier, TSetIdentifier, TStructIdentifier,
};

/// Parses the footer's thrift bytes (without the length and magic) as parquet's `FileMetaData`, bounded.
pub(super) fn check(footer: &[u8]) -> Result<()> {
    let left = Rc::new(Cell::new(footer.len()));
    let reader = Counting {
        bytes: footer,
        left: left.clone(),
    };
    let mut prot = Bounded {
        inner: TCompactInputProtocol::new(reader),
        left,
        refused: None,
    };
    let parsed = parquet::format::FileMetaData::read_from_in_protocol(&mut prot);
    match (parsed, prot.refused) {
        (Ok(_), _) => Ok(()),
        (Err(_), Some(why)) => Err(anyhow!("the footer announces {why}")),
        (Err(e), None) => Err(anyhow!("the footer does not parse: {e}")),
    }
}

/// The footer's bytes, counting down what is left.
struct Counting<'a> {
    bytes: &'a [u8],
    left: Rc<Cell<usize>>,
}

impl Read for Counting<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.bytes.read(buf)?;
        self.left.set(self.bytes.len());
        Ok(n)
    }
}

/// Compact protocol whose collection headers must fit in the bytes left.
struct Bounded<'a> {
    inner: TCompactInputProtocol<Counting<'a>>,
    left: Rc<Cell<usize>>,
    /// Why a collection header was refused.
    refused: Option<String>,
}

impl Bounded<'_> {
    fn fits(&mut self, count: i32, what: &str) -> thrift::Result<()> {
        if usize::try_from(count).is_ok_and(|n| n <= self.left.get()) {
            return Ok(());
        }
        let why = format!(
            "a {what} of {count} elements with {} bytes left",
            self.left.get()
        );
        self.refused = Some(why.clone());
        Err(thrift::Error::Protocol(thrift::ProtocolError::new(
            thrift::ProtocolErrorKind::SizeLimit,
            why,
        )))
    }
}

impl TInputProtocol for Bounded<'_> {
    fn read_list_begin(&mut self) -> thrift::Result<TListIdentifier> {
        let id = self.inner.read_list_begin()?;
        self.fits(id.size, "list")?;
        Ok(id)
    }
    fn read_set_begin(&mut self) -> thrift::Result<TSetIdentifier> {
        let id = self.inner.read_set_begin()?;
        self.fits(id.size, "set")?;
        Ok(id)
    }
    fn read_map_begin(&mut self) -> thrift::Result<TMapIdentifier> {
        let id = self.inner.read_map_begin()?;
        self.fits(id.size, "map")?;
        Ok(id)
    }
    fn read_message_begin(&mut self) -> thrift::Result<TMessageIdentifier> {
        self.inner.read_message_begin()
    }
    fn read_message_end(&mut self) -> thrift::Result<()> {
        self.inner.read_message_end()
    }
    fn read_struct_begin(&mut self) -> thrift::Result<Option<TStructIdentifier>> {
        self.inner.read_struct_begin()
    }
    fn read_struct_end(&mut self) -> thrift::Result<()> {
        self.inner.read_struct_end()
    }
    fn read_field_begin(&mut self) -> thrift::Result<TFieldIdentifier> {
        self.inner.read_field_begin()
    }
    fn read_field_end(&mut self) -> thrift::Result<()> {
        self.inner.read_field_end()
    }
    fn read_bool(&mut self) -> thrift::Result<bool> {
        self.inner.read_bool()
    }
    fn read_bytes(&mut self) -> thrift::Result<Vec<u8>> {
        self.inner.read_bytes()
    }
    fn read_i8(&mut self) -> thrift::Result<i8> {
        self.inner.read_i8()
    }
    fn read_i16(&mut self) -> thrift::Result<i16> {
        self.inner.read_i16()
    }
    fn read_i32(&mut self) -> thrift::Result<i32> {
        self.inner.read_i32()
    }
    fn read_i64(&mut self) -> thrift::Result<i64> {
        self.inner.read_i64()
    }
    fn read_double(&mut self) -> thrift::Result<f64> {
        self.inner.read_double()
    }
    fn read_string(&mut self) -> thrift::Result<String> {
        self.inner.read_string()
    }
    fn read_list_end(&mut self) -> thrift::Result<()> {
        self.inner.read_list_end()
    }
    fn read_set_end(&mut self) -> thrift::Result<()> {
        self.inner.read_set_end()
    }
    fn read_map_end(&mut self) -> thrift::Result<()> {
        self.inner.read_map_end()
    }
    fn read_byte(&mut self) -> thrift::Result<u8> {
        self.inner.read_byte()
    }
}
