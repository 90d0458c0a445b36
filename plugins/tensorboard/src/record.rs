//! TFRecord framing with TensorFlow's masked CRC-32C.

/// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78) of `data`.
pub(crate) fn crc32c(data: &[u8]) -> u32 {
    const TABLE: [u32; 256] = {
        let mut t = [0u32; 256];
        let mut i = 0;
        while i < 256 {
            let mut c = i as u32;
            let mut k = 0;
            while k < 8 {
                c = if c & 1 != 0 {
                    (c >> 1) ^ 0x82F6_3B78
                } else {
                    c >> 1
                };
                k += 1;
            }
            t[i] = c;
            i += 1;
        }
        t
    };
    let mut crc = !0u32;
    for &b in data {
        crc = TABLE[((crc ^ b as u32) & 0xFF) as usize] ^ (crc >> 8);
    }
    !crc
}

/// TensorFlow's masking of a CRC stored next to the data it covers.
pub(crate) fn masked_crc32c(data: &[u8]) -> u32 {
    let crc = crc32c(data);
    (crc.rotate_right(15)).wrapping_add(0xA282_EAD8)
}

/// One TFRecord: length, masked CRC of the length, data, masked CRC of the data (all little-endian).
pub(crate) fn frame(data: &[u8]) -> Vec<u8> {
    let len = (data.len() as u64).to_le_bytes();
    let mut out = Vec::with_capacity(data.len() + 16);
    out.extend_from_slice(&len);
    out.extend_from_slice(&masked_crc32c(&len).to_le_bytes());
    out.extend_from_slice(data);
    out.extend_from_slice(&masked_crc32c(data).to_le_bytes());
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32c_matches_the_standard_check_value() {
        // The CRC-32C check value of "123456789" (RFC 3720, appendix B.4).
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
        assert_eq!(crc32c(b""), 0);
    }

    #[test]
    fn frame_layout() {
        let f = frame(b"abc");
        assert_eq!(f.len(), 8 + 4 + 3 + 4);
        assert_eq!(&f[..8], &3u64.to_le_bytes());
        assert_eq!(&f[12..15], b"abc");
        assert_eq!(
            u32::from_le_bytes(f[15..19].try_into().unwrap()),
            masked_crc32c(b"abc")
        );
    }
}
