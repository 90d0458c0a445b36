//! [`SharedBytes`]: an immutable byte buffer for message fields that carry bulk data (a tensor's bytes, a file, a
//! batch). Cloning it is a reference-count bump, so a caller can send the same buffer again and again without
//! copying it, and decoding it on the receiving side copies nothing: the decoded value points into the received
//! message buffer, which stays alive as long as any such value does (Ray's zero-copy deserialisation of numpy
//! arrays, in Rust). On the wire it is exactly a `Vec<u8>`, so the two are interchangeable between peers.
//!
//! Decoding happens after the whole message was validated (guarantee 8 in `runtime/README.md`), and the received
//! buffer is private to the receiving process (payloads from the same-host ring are copied out before validation),
//! so sharing it is safe.

use std::cell::RefCell;
use std::ops::Deref;

use rkyv::rancor::Fallible;
use rkyv::ser::{Allocator, Writer};
use rkyv::util::AlignedVec;
use rkyv::vec::{ArchivedVec, VecResolver};
use rkyv::{Archive, Deserialize, Place, Serialize};

/// An immutable, cheaply cloned byte buffer that messages carry without copies when received (see the module
/// docs). Build it from a `Vec<u8>`, a `&'static [u8]` or a [`bytes::Bytes`].
#[derive(Clone, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SharedBytes(bytes::Bytes);

impl SharedBytes {
    /// Copies `data` into a new buffer.
    pub fn copy_from_slice(data: &[u8]) -> Self {
        Self(bytes::Bytes::copy_from_slice(data))
    }

    /// The underlying [`bytes::Bytes`].
    pub fn into_bytes(self) -> bytes::Bytes {
        self.0
    }

    /// The bytes as a `Vec<u8>` (copies them).
    pub fn to_vec(&self) -> Vec<u8> {
        self.0.to_vec()
    }

    /// True when this value points into a received message buffer rather than owning a copy (for tests).
    pub fn is_shared_with_message(&self) -> bool {
        let ptr = self.0.as_ptr() as usize;
        RECEIVED.with(|r| {
            r.borrow()
                .iter()
                .any(|(start, len)| ptr >= *start && ptr + self.0.len() <= start + len)
        })
    }
}

impl std::fmt::Debug for SharedBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SharedBytes({} bytes)", self.0.len())
    }
}

impl Deref for SharedBytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.0
    }
}

impl AsRef<[u8]> for SharedBytes {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

impl From<Vec<u8>> for SharedBytes {
    fn from(v: Vec<u8>) -> Self {
        Self(v.into())
    }
}

impl From<bytes::Bytes> for SharedBytes {
    fn from(b: bytes::Bytes) -> Self {
        Self(b)
    }
}

impl From<&'static [u8]> for SharedBytes {
    fn from(b: &'static [u8]) -> Self {
        Self(bytes::Bytes::from_static(b))
    }
}

impl Archive for SharedBytes {
    type Archived = ArchivedVec<u8>;
    type Resolver = VecResolver;

    fn resolve(&self, resolver: VecResolver, out: Place<ArchivedVec<u8>>) {
        ArchivedVec::resolve_from_len(self.0.len(), resolver, out);
    }
}

impl<S: Fallible + Allocator + Writer + ?Sized> Serialize<S> for SharedBytes {
    fn serialize(&self, serializer: &mut S) -> Result<VecResolver, S::Error> {
        ArchivedVec::<u8>::serialize_from_slice(&self.0[..], serializer)
    }
}

impl<D: Fallible + ?Sized> Deserialize<SharedBytes, D> for ArchivedVec<u8> {
    fn deserialize(&self, _: &mut D) -> Result<SharedBytes, D::Error> {
        let slice = self.as_slice();
        let shared = OWNER.with(|o| {
            o.borrow()
                .as_ref()
                .filter(|owner| contains(owner, slice))
                .map(|owner| owner.slice_ref(slice))
        });
        Ok(SharedBytes(
            shared.unwrap_or_else(|| bytes::Bytes::copy_from_slice(slice)),
        ))
    }
}

fn contains(owner: &bytes::Bytes, slice: &[u8]) -> bool {
    let (start, ptr) = (owner.as_ptr() as usize, slice.as_ptr() as usize);
    ptr >= start && ptr + slice.len() <= start + owner.len()
}

thread_local! {
    /// The message buffer being decoded on this thread, if it may be shared.
    static OWNER: RefCell<Option<bytes::Bytes>> = const { RefCell::new(None) };
    /// Received buffers (start, length) that were shared on this thread, for [`SharedBytes::is_shared_with_message`].
    static RECEIVED: RefCell<Vec<(usize, usize)>> = const { RefCell::new(Vec::new()) };
}

/// A received message buffer: goes back to the pool of large buffers when the last value sharing it is dropped.
struct Received(AlignedVec);

impl AsRef<[u8]> for Received {
    fn as_ref(&self) -> &[u8] {
        self.0.as_slice()
    }
}

impl Drop for Received {
    fn drop(&mut self) {
        super::pool::recycle(std::mem::take(&mut self.0));
    }
}

/// Runs `decode` on `buffer` with [`SharedBytes`] fields sharing it instead of copying; the buffer lives as long as
/// the longest-lived of them (and is recycled then).
pub(crate) fn decode_sharing<T>(buffer: AlignedVec, decode: impl FnOnce(&[u8]) -> T) -> T {
    struct Restore(Option<bytes::Bytes>);
    impl Drop for Restore {
        fn drop(&mut self) {
            let prev = self.0.take();
            OWNER.with(|o| *o.borrow_mut() = prev);
        }
    }
    let owner = bytes::Bytes::from_owner(Received(buffer));
    RECEIVED.with(|r| {
        let mut r = r.borrow_mut();
        if r.len() >= 64 {
            r.remove(0);
        }
        r.push((owner.as_ptr() as usize, owner.len()));
    });
    let _restore = Restore(OWNER.with(|o| o.replace(Some(owner.clone()))));
    decode(&owner)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::Wire;

    #[derive(Archive, Serialize, Deserialize, Debug, PartialEq)]
    struct WithBlob {
        tag: u32,
        data: SharedBytes,
    }

    #[derive(Archive, Serialize, Deserialize, Debug, PartialEq)]
    struct WithVec {
        tag: u32,
        data: Vec<u8>,
    }

    #[test]
    fn decoding_shares_the_received_buffer_and_matches_vec_on_the_wire() {
        let payload: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
        let sent = WithBlob {
            tag: 9,
            data: payload.clone().into(),
        };
        let bytes = sent.to_wire().unwrap();
        // Same bytes as a Vec<u8> field: peers may use either type.
        let as_vec = WithVec::from_wire(&bytes).unwrap();
        assert_eq!(as_vec.data, payload);
        assert_eq!(
            WithVec {
                tag: 9,
                data: payload.clone()
            }
            .to_wire()
            .unwrap()
            .as_slice(),
            bytes.as_slice()
        );

        let got = WithBlob::from_wire_owned(bytes).unwrap();
        assert_eq!(got.tag, 9);
        assert_eq!(&got.data[..], &payload[..]);
        assert!(got.data.is_shared_with_message(), "no copy on decode");

        // Plain decoding from a borrowed slice copies (nothing owns the bytes).
        let copied = WithBlob::from_wire(&sent.to_wire().unwrap()).unwrap();
        assert_eq!(&copied.data[..], &payload[..]);
        assert!(!copied.data.is_shared_with_message());
    }

    #[test]
    fn a_malformed_buffer_is_refused_before_anything_is_shared() {
        let sent = WithBlob {
            tag: 1,
            data: vec![1, 2, 3].into(),
        };
        let mut bytes = sent.to_wire().unwrap();
        let n = bytes.len();
        // Point the vector's relative offset far outside the buffer.
        bytes[n - 8..n - 4].copy_from_slice(&0x7fff_0000u32.to_le_bytes());
        assert!(WithBlob::from_wire_owned(bytes).is_err());
    }
}
