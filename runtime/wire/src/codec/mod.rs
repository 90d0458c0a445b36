//! The codec: how a value becomes bytes and back. Every message is rkyv, validated with bytecheck on receipt; nothing read from a socket is trusted.
//!
//! A frame is `[u32 length, little endian][u16 wire version][rkyv bytes]`, where the length counts the version and the
//! body. A frame longer than the reader's maximum, of another version, or whose body fails validation is a
//! [`FrameError`]; the transport closes that connection and logs the reason (guarantee 8 in `runtime/README.md`).
//! Bulk payloads (large arguments and replies) travel on their own unidirectional streams (the runtime's transport).
//!
//! Also here: the [`Message`] and [`StreamMessage`] traits a message type implements, the pool of large buffers
//! ([`pool`]) and [`SharedBytes`], the byte field that decodes without a copy.

use rkyv::api::high::{HighSerializer, HighValidator};
use rkyv::bytecheck::CheckBytes;
use rkyv::de::Pool;
use rkyv::rancor::{self, Strategy};
use rkyv::ser::allocator::ArenaHandle;
use rkyv::ser::{Positional, Writer};
use rkyv::util::AlignedVec;
use rkyv::{Archive, Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncReadExt};

mod message;
pub mod pool;
mod shared_bytes;

pub use message::{Message, StreamMessage};
pub use shared_bytes::SharedBytes;

/// The version written in every frame header; a peer speaking another version is disconnected.
pub const WIRE_VERSION: u16 = 5;
/// Default largest frame a reader accepts (64 MiB); larger payloads must go on bulk streams.
pub const DEFAULT_MAX_FRAME: usize = 64 << 20;
/// Size of the frame header: length and version.
pub const FRAME_HEADER: usize = 6;

/// A value that can be sent over the wire: rkyv-serialisable, and validated with bytecheck when decoded.
///
/// Implemented for every type deriving `rkyv::{Archive, Serialize, Deserialize}` (plain `#[derive]`, from any crate).
pub trait Wire: Sized + Send + 'static {
    /// Serialises `self` into aligned rkyv bytes.
    fn to_wire(&self) -> Result<AlignedVec, WireError>;
    /// Validates and deserialises rkyv bytes (copies them first when they are not aligned).
    fn from_wire(bytes: &[u8]) -> Result<Self, WireError>;
    /// Like [`Wire::from_wire`], taking the received buffer: [`crate::SharedBytes`] fields point into it instead of
    /// copying (small buffers are simply decoded).
    fn from_wire_owned(bytes: AlignedVec) -> Result<Self, WireError>;
}

/// An rkyv writer that only counts bytes: a first pass with it sizes the buffer of the real one, so a large message
/// is written once into a buffer of the right size (no regrowth copies, and a recycled buffer when one fits).
#[derive(Default)]
pub struct SizeCounter(usize);

impl Positional for SizeCounter {
    fn pos(&self) -> usize {
        self.0
    }
}

impl<E> Writer<E> for SizeCounter {
    fn write(&mut self, bytes: &[u8]) -> Result<(), E> {
        self.0 += bytes.len();
        Ok(())
    }
}

impl<T> Wire for T
where
    T: Archive
        + for<'a> Serialize<HighSerializer<AlignedVec, ArenaHandle<'a>, rancor::Error>>
        + for<'a> Serialize<HighSerializer<SizeCounter, ArenaHandle<'a>, rancor::Error>>
        + Send
        + 'static,
    T::Archived: for<'a> CheckBytes<HighValidator<'a, rancor::Error>>
        + Deserialize<T, Strategy<Pool, rancor::Error>>,
{
    fn to_wire(&self) -> Result<AlignedVec, WireError> {
        let encode = |e: rancor::Error| WireError::Encode(e.to_string());
        let size = rkyv::api::high::to_bytes_in::<_, rancor::Error>(self, SizeCounter(0))
            .map_err(encode)?
            .0;
        rkyv::api::high::to_bytes_in::<_, rancor::Error>(self, pool::buffer(size)).map_err(encode)
    }

    fn from_wire(bytes: &[u8]) -> Result<Self, WireError> {
        let decode = |b: &[u8]| {
            rkyv::from_bytes::<T, rancor::Error>(b).map_err(|e| WireError::Malformed(e.to_string()))
        };
        if (bytes.as_ptr() as usize).is_multiple_of(16) {
            decode(bytes)
        } else {
            let mut aligned = AlignedVec::<16>::with_capacity(bytes.len());
            aligned.extend_from_slice(bytes);
            decode(&aligned)
        }
    }

    fn from_wire_owned(bytes: AlignedVec) -> Result<Self, WireError> {
        if bytes.len() < pool::LARGE {
            let decoded = Self::from_wire(&bytes);
            pool::recycle(bytes);
            return decoded;
        }
        shared_bytes::decode_sharing(bytes, Self::from_wire)
    }
}

/// Why bytes could not be turned into a message or a message into bytes.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum WireError {
    /// Serialisation failed.
    #[error("could not encode message: {0}")]
    Encode(String),
    /// The bytes are not a valid archive of the expected type.
    #[error("malformed message: {0}")]
    Malformed(String),
}

/// Why a frame was rejected; the connection carrying it is closed with this reason.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    /// The announced length exceeds the reader's maximum.
    #[error("frame of {len} bytes exceeds the maximum of {max} bytes")]
    TooLarge {
        /// Announced length.
        len: usize,
        /// The reader's maximum.
        max: usize,
    },
    /// The peer speaks another wire version.
    #[error("frame has wire version {got}, this build speaks version {WIRE_VERSION}")]
    WrongVersion {
        /// Version found in the header.
        got: u16,
    },
    /// The length is too small to hold a version.
    #[error("frame of {0} bytes is too short to hold a header")]
    TooShort(usize),
    /// The body failed validation.
    #[error(transparent)]
    Malformed(#[from] WireError),
    /// The stream failed or ended mid-frame.
    #[error("stream error: {0}")]
    Io(#[from] std::io::Error),
}

/// Appends one framed message to `out`.
pub fn encode_frame<T: Wire>(value: &T, out: &mut Vec<u8>) -> Result<(), WireError> {
    let body = value.to_wire()?;
    out.extend_from_slice(&((body.len() + 2) as u32).to_le_bytes());
    out.extend_from_slice(&WIRE_VERSION.to_le_bytes());
    out.extend_from_slice(&body);
    Ok(())
}

/// Reads one frame body into `buf` (aligned, ready for validation). Returns `Ok(false)` on a clean end of stream.
pub async fn read_frame<R: AsyncRead + Unpin>(
    reader: &mut R,
    max: usize,
    buf: &mut AlignedVec,
) -> Result<bool, FrameError> {
    let mut header = [0u8; FRAME_HEADER];
    let mut got = 0;
    while got < FRAME_HEADER {
        let n = reader.read(&mut header[got..]).await?;
        if n == 0 {
            if got == 0 {
                return Ok(false);
            }
            return Err(FrameError::Io(std::io::ErrorKind::UnexpectedEof.into()));
        }
        got += n;
    }
    let len = u32::from_le_bytes(header[..4].try_into().expect("4 bytes")) as usize;
    if len > max {
        return Err(FrameError::TooLarge { len, max });
    }
    if len < 2 {
        return Err(FrameError::TooShort(len));
    }
    let version = u16::from_le_bytes([header[4], header[5]]);
    if version != WIRE_VERSION {
        return Err(FrameError::WrongVersion { got: version });
    }
    buf.clear();
    buf.resize(len - 2, 0);
    reader.read_exact(buf.as_mut_slice()).await?;
    Ok(true)
}

/// Reads and decodes one frame; `Ok(None)` on a clean end of stream.
pub async fn read_message<T: Wire, R: AsyncRead + Unpin>(
    reader: &mut R,
    max: usize,
    buf: &mut AlignedVec,
) -> Result<Option<T>, FrameError> {
    if !read_frame(reader, max, buf).await? {
        return Ok(None);
    }
    Ok(Some(T::from_wire(buf)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Archive, Serialize, Deserialize, Debug, PartialEq)]
    struct Sample {
        id: u64,
        name: String,
        data: Vec<u8>,
    }

    #[tokio::test]
    async fn guarantee_8_round_trip_and_validation() {
        let v = Sample {
            id: 7,
            name: "x".into(),
            data: vec![1, 2, 3],
        };
        let mut out = Vec::new();
        encode_frame(&v, &mut out).unwrap();
        let mut buf = AlignedVec::new();
        let got: Sample = read_message(&mut out.as_slice(), 1024, &mut buf)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(got, v);
        // Clean end of stream.
        let none: Option<Sample> = read_message(&mut [].as_slice(), 1024, &mut buf)
            .await
            .unwrap();
        assert!(none.is_none());
    }

    #[tokio::test]
    async fn guarantee_8_oversized_wrong_version_and_garbage_are_rejected() {
        let mut buf = AlignedVec::new();
        let mut big = Vec::new();
        big.extend_from_slice(&(1u32 << 30).to_le_bytes());
        big.extend_from_slice(&WIRE_VERSION.to_le_bytes());
        let err = read_frame(&mut big.as_slice(), 1024, &mut buf)
            .await
            .unwrap_err();
        assert!(
            matches!(
                err,
                FrameError::TooLarge {
                    len: 1073741824,
                    max: 1024
                }
            ),
            "{err}"
        );

        let mut wrong = Vec::new();
        encode_frame(
            &Sample {
                id: 1,
                name: String::new(),
                data: vec![],
            },
            &mut wrong,
        )
        .unwrap();
        wrong[4] = 99;
        let err = read_frame(&mut wrong.as_slice(), 1024, &mut buf)
            .await
            .unwrap_err();
        assert!(matches!(err, FrameError::WrongVersion { got: 99 }), "{err}");

        let mut garbage = Vec::new();
        garbage.extend_from_slice(&34u32.to_le_bytes());
        garbage.extend_from_slice(&WIRE_VERSION.to_le_bytes());
        garbage.extend_from_slice(&[0xff; 32]);
        let err = read_message::<Sample, _>(&mut garbage.as_slice(), 1024, &mut buf)
            .await
            .unwrap_err();
        assert!(matches!(err, FrameError::Malformed(_)), "{err}");
    }
}
