//! The few protobuf messages of TensorBoard's `Event` we write, encoded by hand:
//!
//! ```text
//! Event   { double wall_time = 1; int64 step = 2; string file_version = 3; Summary summary = 5; }
//! Summary { repeated Value value = 1; }
//! Value   { string tag = 1; float simple_value = 2; }
//! ```

const WIRE_VARINT: u8 = 0;
const WIRE_FIXED64: u8 = 1;
const WIRE_LEN: u8 = 2;
const WIRE_FIXED32: u8 = 5;

fn varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn key(out: &mut Vec<u8>, field: u32, wire: u8) {
    varint(out, ((field as u64) << 3) | wire as u64);
}

fn bytes_field(out: &mut Vec<u8>, field: u32, bytes: &[u8]) {
    key(out, field, WIRE_LEN);
    varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

fn wall_time(out: &mut Vec<u8>, secs: f64) {
    key(out, 1, WIRE_FIXED64);
    out.extend_from_slice(&secs.to_le_bytes());
}

/// The first event of a file: `file_version = "brain.Event:2"`.
pub(crate) fn file_version_event(secs: f64) -> Vec<u8> {
    let mut out = Vec::new();
    wall_time(&mut out, secs);
    bytes_field(&mut out, 3, b"brain.Event:2");
    out
}

/// An event with one scalar value per metric at `step`.
pub(crate) fn scalars_event(secs: f64, step: i64, metrics: &[(&str, f64)]) -> Vec<u8> {
    let mut summary = Vec::new();
    for (tag, value) in metrics {
        let mut v = Vec::new();
        bytes_field(&mut v, 1, tag.as_bytes());
        key(&mut v, 2, WIRE_FIXED32);
        v.extend_from_slice(&(*value as f32).to_le_bytes());
        bytes_field(&mut summary, 1, &v);
    }
    let mut out = Vec::new();
    wall_time(&mut out, secs);
    key(&mut out, 2, WIRE_VARINT);
    varint(&mut out, step as u64);
    bytes_field(&mut out, 5, &summary);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn varints_encode_like_protobuf() {
        let mut out = Vec::new();
        varint(&mut out, 300);
        assert_eq!(out, [0xAC, 0x02]);
    }

    #[test]
    fn scalar_event_bytes() {
        let e = scalars_event(0.0, 1, &[("a", 1.0)]);
        // wall_time: key 0x09 + 8 bytes; step: 0x10 0x01; summary: 0x2A len { 0x0A len { 0x0A 1 'a' 0x15 f32 } }
        let mut want = vec![0x09];
        want.extend_from_slice(&0f64.to_le_bytes());
        want.extend_from_slice(&[0x10, 0x01, 0x2A, 0x0A, 0x0A, 0x08, 0x0A, 0x01, b'a', 0x15]);
        want.extend_from_slice(&1f32.to_le_bytes());
        assert_eq!(e, want);
    }
}
