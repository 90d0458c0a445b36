//! The same-host ring of one call-stream direction (guarantee 13): a one-ring `ferl-shm` segment, offered in a
//! [`Frame::ShmOffer`] on the (authenticated, encrypted) QUIC stream. Payloads are placed whole with
//! [`Producer::try_put`]; the frame's `Body::Shared { offset, len }` carries the position it returned, and the
//! receiver takes payloads in stream order, which frees their space for the writer.

use std::sync::atomic::Ordering;

use ferl_shm::{Consumer, Offer, Producer, Segment, NONCE_LEN};
use rkyv::util::AlignedVec;

use super::{buffer, MAX_SHM_BYTES, SHM_BYTES_RECEIVED};
use crate::protocol::Frame;

/// The writer's side of a ring.
pub(crate) struct SendRing {
    segment: Segment,
    producer: Producer,
}

impl SendRing {
    /// Creates a ring of the largest power of two of bytes not above `capacity` (at least one page).
    pub(crate) fn create(capacity: u64) -> std::io::Result<Self> {
        let capacity =
            usize::try_from(capacity.min(MAX_SHM_BYTES)).map_err(std::io::Error::other)?;
        if capacity < ferl_shm::MIN_RING_BYTES {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("a ring of {capacity} bytes is below one page"),
            ));
        }
        let ring_bytes = 1usize << (usize::BITS - 1 - capacity.leading_zeros());
        let segment = Segment::create(1, ring_bytes, false)?;
        let producer = segment.producer(0);
        Ok(Self { segment, producer })
    }

    /// The frame that offers this ring to the peer.
    pub(crate) fn offer(&self) -> Frame {
        let offer = self
            .segment
            .offer()
            .expect("a ring keeps its descriptor until the peer uses it");
        Frame::ShmOffer {
            pid: offer.pid,
            fd: offer.fd,
            capacity: offer.ring_bytes,
            nonce: offer.nonce.to_vec(),
        }
    }

    /// Copies `bytes` into the ring and returns their position, or `None` when the ring has no room for them now.
    /// Called only once the peer accepted the offer: the first call closes the ring's descriptor.
    pub(crate) fn put(&mut self, bytes: &[u8]) -> Option<u64> {
        self.segment.close_fd();
        self.producer.try_put(bytes)
    }
}

/// The reader's side of a peer's ring, mapped after checking its offer.
pub(crate) struct RecvRing {
    _segment: Segment,
    consumer: Consumer,
}

impl RecvRing {
    /// Opens and maps the ring a peer offered; the error says why it cannot be used (then payloads stay on QUIC).
    pub(crate) fn open(pid: u32, fd: i32, capacity: u64, nonce: &[u8]) -> Result<Self, String> {
        let nonce: [u8; NONCE_LEN] = nonce.try_into().map_err(|_| {
            format!(
                "ring offer has a {}-byte nonce, expected {NONCE_LEN}",
                nonce.len()
            )
        })?;
        if capacity == 0 || capacity > MAX_SHM_BYTES {
            return Err(format!(
                "ring offer of {capacity} bytes is outside 1..={MAX_SHM_BYTES}"
            ));
        }
        let offer = Offer {
            pid,
            fd,
            rings: 1,
            ring_bytes: capacity,
            nonce,
        };
        let segment = Segment::accept(&offer).map_err(|e| e.to_string())?;
        let consumer = segment.consumer(0);
        Ok(Self {
            _segment: segment,
            consumer,
        })
    }

    /// Copies the payload at position `offset` out of the ring and frees its space; a region the writer did not
    /// publish (or already freed) is an error (the connection is then closed).
    pub(crate) fn take(&mut self, offset: u64, len: u64) -> Result<AlignedVec, String> {
        let out = self
            .consumer
            .take(offset, len, |bytes| {
                let mut out = buffer(bytes.len());
                out.extend_from_slice(bytes);
                out
            })
            .map_err(|e| e.to_string())?;
        SHM_BYTES_RECEIVED.fetch_add(len, Ordering::Relaxed);
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::bulk::shm_bytes_received;

    fn open(offer: &Frame) -> Result<RecvRing, String> {
        let Frame::ShmOffer {
            pid,
            fd,
            capacity,
            nonce,
        } = offer
        else {
            panic!("offer frame");
        };
        RecvRing::open(*pid, *fd, *capacity, nonce)
    }

    #[test]
    fn guarantee_13_a_ring_round_trips_through_proc_and_rejects_wrong_offers() {
        let mut send = SendRing::create(1 << 20).unwrap();
        let offer = send.offer();
        let mut recv = open(&offer).unwrap();
        let payload: Vec<u8> = (0..200_000u32).map(|i| i as u8).collect();
        let at = send.put(&payload).unwrap();
        let before = shm_bytes_received();
        let got = recv.take(at, payload.len() as u64).unwrap();
        assert_eq!(got.as_slice(), payload.as_slice());
        assert!(shm_bytes_received() - before >= payload.len() as u64);
        // Consumed: a drained ring starts over at its beginning (the next multiple of its size).
        assert_eq!(send.put(&payload), Some(1 << 20));
        let err = recv
            .take((1 << 20) + 10, payload.len() as u64)
            .err()
            .unwrap();
        assert!(err.contains("outside"), "{err}");
        let err = recv.take(u64::MAX, 2).err().unwrap();
        assert!(err.contains("outside"), "{err}");

        // The descriptor was closed by the first put: a fresh ring for the refusals.
        let fresh = SendRing::create(1 << 20).unwrap();
        let Frame::ShmOffer {
            pid,
            fd,
            capacity,
            nonce,
        } = fresh.offer()
        else {
            unreachable!()
        };
        assert!(open(&offer).is_err(), "a used ring's offer opens nothing");
        let mut wrong_nonce = nonce.clone();
        wrong_nonce[0] ^= 1;
        let err = RecvRing::open(pid, fd, capacity, &wrong_nonce)
            .err()
            .unwrap();
        assert!(err.contains("not the segment offered"), "{err}");
        let err = RecvRing::open(pid, fd, capacity * 2, &nonce).err().unwrap();
        assert!(err.contains("the offer says"), "{err}");
        let err = RecvRing::open(pid, fd, capacity, &nonce[..8])
            .err()
            .unwrap();
        assert!(err.contains("nonce"), "{err}");
        let err = RecvRing::open(pid, 1_000_000, capacity, &nonce)
            .err()
            .unwrap();
        assert!(err.contains("cannot open"), "{err}");
    }

    #[test]
    fn guarantee_13_ring_sizes_round_down_to_a_power_of_two() {
        let send = SendRing::create((3 << 20) + 5).unwrap();
        let Frame::ShmOffer { capacity, .. } = send.offer() else {
            unreachable!()
        };
        assert_eq!(capacity, 2 << 20);
        assert!(SendRing::create(100).is_err());
    }

    #[test]
    fn guarantee_13_a_full_ring_refuses_until_the_reader_takes_in_order() {
        let mut send = SendRing::create(256 << 10).unwrap();
        let mut recv = open(&send.offer()).unwrap();
        let payload = vec![5u8; 100 << 10];
        let a = send.put(&payload).unwrap();
        let b = send.put(&payload).unwrap();
        assert_eq!(send.put(&payload), None, "only 56 KiB are left");
        recv.take(a, payload.len() as u64).unwrap();
        let c = send.put(&payload).unwrap();
        assert_eq!(c, 256 << 10, "wrapped to the ring's start");
        recv.take(b, payload.len() as u64).unwrap();
        recv.take(c, payload.len() as u64).unwrap();
        assert!(recv.take(c, payload.len() as u64).is_err(), "taken twice");
    }
}
