//! The connection of one rank to one peer, over whichever transport the pair negotiated: shared memory for ranks on
//! the same host, TCP otherwise. The engine sees one byte stream per direction, cut into frames.

use super::shm::ShmLink;
use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream};

/// How two ranks exchange bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transport {
    /// A TCP connection (ranks on different hosts, or shared memory disabled or unavailable).
    Tcp,
    /// Rings in a shared-memory segment (ranks on the same host); the TCP connection only watches the peer's liveness.
    SharedMemory,
}

/// One connection to another rank.
pub(crate) struct Peer {
    /// The TCP handle this rank reads from.
    read: TcpStream,
    /// The same socket, so one thread can write while another reads.
    write: TcpStream,
    /// Set when the pair talks through shared memory.
    shm: Option<ShmLink>,
}

impl Peer {
    /// A peer reached over `stream`, through `shm` when the pair negotiated it.
    pub(super) fn new(stream: TcpStream, shm: Option<ShmLink>) -> std::io::Result<Self> {
        Ok(Self {
            write: stream.try_clone()?,
            read: stream,
            shm,
        })
    }

    /// The transport in use.
    pub(super) fn transport(&self) -> Transport {
        if self.shm.is_some() {
            Transport::SharedMemory
        } else {
            Transport::Tcp
        }
    }

    /// Sends `bytes` (part of the current frame).
    pub(super) fn send(&self, bytes: &[u8]) -> std::io::Result<()> {
        match &self.shm {
            Some(shm) => shm.send(bytes),
            None => (&self.write).write_all(bytes),
        }
    }

    /// Ends the frame being sent.
    pub(super) fn end_send_frame(&self) -> std::io::Result<()> {
        match &self.shm {
            Some(shm) => shm.end_send_frame(),
            None => Ok(()),
        }
    }

    /// Receives exactly `buf.len()` bytes of the current frame.
    pub(super) fn recv_exact(&self, buf: &mut [u8]) -> std::io::Result<()> {
        match &self.shm {
            Some(shm) => shm.recv_exact(buf),
            None => (&self.read).read_exact(buf),
        }
    }

    /// Receives `len` bytes of the current frame, handing them to `consume(offset, bytes)` piece by piece, each piece
    /// a multiple of `unit` bytes: in place from shared memory, or through `scratch` (which must hold at least `unit`
    /// bytes) from TCP.
    pub(super) fn recv_pieces(
        &self,
        len: usize,
        unit: usize,
        scratch: &mut [u8],
        mut consume: impl FnMut(usize, &[u8]),
    ) -> std::io::Result<()> {
        match &self.shm {
            Some(shm) => shm.recv_pieces(len, unit, consume),
            None => {
                let step = (scratch.len() / unit * unit).max(unit);
                let mut off = 0;
                while off < len {
                    let n = step.min(len - off);
                    (&self.read).read_exact(&mut scratch[..n])?;
                    consume(off, &scratch[..n]);
                    off += n;
                }
                Ok(())
            }
        }
    }

    /// Ends the frame being received.
    pub(super) fn end_recv_frame(&self) -> std::io::Result<()> {
        match &self.shm {
            Some(shm) => shm.end_recv_frame(),
            None => Ok(()),
        }
    }

    /// Closes the connection both ways, so blocked transfers on this rank and on the peer return at once.
    pub(super) fn shutdown(&self) {
        if let Some(shm) = &self.shm {
            shm.close();
        }
        let _ = self.read.shutdown(Shutdown::Both);
    }
}
