//! Unit tests of shared-memory blobs: the bytes an opener maps, the seals, and offers that must be refused.

use super::*;
use std::os::fd::AsRawFd;

/// A finished blob holding `0, 1, 2, …` (mod 251) over `len` bytes.
fn counting_blob(len: usize) -> Blob {
    let mut writer = BlobWriter::create(len).unwrap();
    for (i, b) in writer.data_mut().iter_mut().enumerate() {
        *b = (i % 251) as u8;
    }
    writer.finish().unwrap()
}

#[test]
fn an_opened_blob_maps_the_written_bytes() {
    let blob = counting_blob(3 * 4096 + 17);
    let opened = Blob::open(&blob.offer().unwrap()).unwrap();
    assert_eq!(opened.data(), blob.data());
    assert_eq!(opened.data()[4096 + 5], ((4096 + 5) % 251) as u8);
    assert!(opened.offer().is_none(), "only the creator offers");
}

#[test]
fn an_empty_blob_opens() {
    let blob = BlobWriter::create(0).unwrap().finish().unwrap();
    assert!(Blob::open(&blob.offer().unwrap())
        .unwrap()
        .data()
        .is_empty());
}

#[test]
fn mapped_bytes_outlive_the_creator() {
    let blob = counting_blob(10_000);
    let opened = Blob::open(&blob.offer().unwrap()).unwrap();
    let want = blob.data().to_vec();
    drop(blob);
    assert_eq!(opened.data(), &want[..]);
}

#[test]
fn a_finished_blob_cannot_be_written_or_resized() {
    let blob = counting_blob(8192);
    let offer = blob.offer().unwrap();
    let path = format!("/proc/{}/fd/{}", offer.pid, offer.fd);
    use std::io::Write;
    let mut writable = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    let fd = writable.as_raw_fd();
    // SAFETY: plain calls on a descriptor this test owns.
    let (seals, truncated) =
        unsafe { (libc::fcntl(fd, libc::F_GET_SEALS), libc::ftruncate(fd, 1)) };
    let sealed = libc::F_SEAL_WRITE | libc::F_SEAL_GROW | libc::F_SEAL_SHRINK | libc::F_SEAL_SEAL;
    assert_eq!(seals & sealed, sealed, "seals {seals:#x}");
    // A writable descriptor: only the seals can refuse the resize (EPERM) and the write.
    assert_eq!(truncated, -1);
    assert_eq!(
        std::io::Error::last_os_error().raw_os_error(),
        Some(libc::EPERM)
    );
    assert!(writable.write_all(b"x").is_err());
}

#[test]
fn offers_that_do_not_match_are_refused() {
    let blob = counting_blob(4096);
    let offer = blob.offer().unwrap();
    let mut wrong_nonce = offer;
    wrong_nonce.nonce[0] ^= 1;
    let e = Blob::open(&wrong_nonce).unwrap_err();
    assert!(e.to_string().contains("is not the blob offered"), "{e}");
    let mut wrong_len = offer;
    wrong_len.len += 1;
    let e = Blob::open(&wrong_len).unwrap_err();
    assert!(e.to_string().contains("the offer says"), "{e}");
    let mut no_such_fd = offer;
    no_such_fd.fd = 100_000;
    let e = Blob::open(&no_such_fd).unwrap_err();
    assert!(e.to_string().contains("cannot open"), "{e}");
}

#[test]
fn a_ring_segment_is_not_a_blob() {
    let segment = Segment::create(1, 4096, false).unwrap();
    let ring = segment.offer().unwrap();
    let offer = BlobOffer {
        pid: ring.pid,
        fd: ring.fd,
        len: 8192,
        nonce: ring.nonce,
    };
    // The segment is 8192 + 4096 bytes, like a blob of 8192 bytes, but lacks the write seal and the blob's magic.
    let e = Blob::open(&offer).unwrap_err();
    assert!(e.to_string().contains("not sealed as offered"), "{e}");
}

#[test]
fn after_close_fd_the_offer_no_longer_opens() {
    let blob = counting_blob(100);
    let offer = blob.offer().unwrap();
    blob.close_fd();
    assert!(blob.offer().is_none());
    assert!(Blob::open(&offer).is_err());
    assert_eq!(blob.data()[99], 99);
}
