//! Closing an abusive connection the way HTTP/2 says: a GOAWAY frame with
//! ENHANCE_YOUR_CALM, written between two of the transport's own frames.
//!
//! The transport (hyper) owns the HTTP/2 session and offers no way to end
//! one with an error code. The connection's IO sees every byte it writes,
//! though, and HTTP/2 frames are self-delimiting (a 9-byte header with the
//! payload's length): [`Frames`] follows them, so that the GOAWAY goes out
//! exactly where a frame ends, and the connection is closed after it.

/// HTTP/2 error code ENHANCE_YOUR_CALM (RFC 9113, section 7).
pub(super) const ENHANCE_YOUR_CALM: u32 = 0xb;

const HEADER: usize = 9;
/// The client's connection preface.
const PREFACE: usize = 24;
const HEADERS_FRAME: u8 = 0x1;
const GOAWAY_FRAME: u8 = 0x7;

/// Where the frames of one direction of an HTTP/2 connection begin and end,
/// from the bytes that pass, and the highest stream a HEADERS frame opened.
#[derive(Debug)]
pub(super) struct Frames {
    preface_left: usize,
    header: [u8; HEADER],
    have: usize,
    payload_left: usize,
    last_stream: u32,
}

impl Frames {
    /// What a client sends: the preface, then frames.
    pub(super) fn from_client() -> Self {
        Self {
            preface_left: PREFACE,
            ..Self::from_server()
        }
    }

    /// What a server sends: frames from the first byte.
    pub(super) fn from_server() -> Self {
        Self {
            preface_left: 0,
            header: [0; HEADER],
            have: 0,
            payload_left: 0,
            last_stream: 0,
        }
    }

    /// Whether the bytes so far end a frame.
    pub(super) fn at_boundary(&self) -> bool {
        self.preface_left == 0 && self.have == 0 && self.payload_left == 0
    }

    /// How many bytes may pass before the current frame (or header) ends;
    /// `usize::MAX` at a boundary.
    pub(super) fn room(&self) -> usize {
        if self.preface_left > 0 {
            self.preface_left
        } else if self.have > 0 {
            HEADER - self.have
        } else if self.payload_left > 0 {
            self.payload_left
        } else {
            usize::MAX
        }
    }

    /// The highest stream id a HEADERS frame used.
    pub(super) fn last_stream(&self) -> u32 {
        self.last_stream
    }

    /// Follows `bytes`, which passed in this direction.
    pub(super) fn pass(&mut self, mut bytes: &[u8]) {
        while !bytes.is_empty() {
            let n = if self.preface_left > 0 {
                let n = self.preface_left.min(bytes.len());
                self.preface_left -= n;
                n
            } else if self.payload_left > 0 {
                let n = self.payload_left.min(bytes.len());
                self.payload_left -= n;
                n
            } else {
                let n = (HEADER - self.have).min(bytes.len());
                self.header[self.have..self.have + n].copy_from_slice(&bytes[..n]);
                self.have += n;
                if self.have == HEADER {
                    self.header_done();
                }
                n
            };
            bytes = &bytes[n..];
        }
    }

    fn header_done(&mut self) {
        let h = &self.header;
        self.payload_left = usize::from(h[0]) << 16 | usize::from(h[1]) << 8 | usize::from(h[2]);
        let stream = u32::from_be_bytes([h[5], h[6], h[7], h[8]]) & 0x7fff_ffff;
        if h[3] == HEADERS_FRAME {
            self.last_stream = self.last_stream.max(stream);
        }
        self.have = 0;
    }
}

/// A GOAWAY frame: `last_stream` is the highest stream the sender may have
/// acted on, `code` the error code.
pub(super) fn goaway(last_stream: u32, code: u32) -> [u8; HEADER + 8] {
    let mut f = [0u8; HEADER + 8];
    f[2] = 8;
    f[3] = GOAWAY_FRAME;
    f[9..13].copy_from_slice(&(last_stream & 0x7fff_ffff).to_be_bytes());
    f[13..17].copy_from_slice(&code.to_be_bytes());
    f
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(kind: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
        let len = payload.len();
        let mut f = vec![(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, 0];
        f.extend_from_slice(&stream.to_be_bytes());
        f.extend_from_slice(payload);
        f
    }

    #[test]
    fn frames_are_followed_across_any_split() {
        let mut bytes = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
        bytes.extend(frame(0x4, 0, &[0; 6]));
        bytes.extend(frame(HEADERS_FRAME, 1, &[7; 20]));
        bytes.extend(frame(0x0, 1, &[]));
        bytes.extend(frame(HEADERS_FRAME, 5, &[7; 300]));
        // Every byte at which a frame ends, for each way of cutting the
        // bytes in two.
        let ends = [24, 24 + 15, 24 + 15 + 29, 24 + 15 + 29 + 9, bytes.len()];
        for cut in 0..=bytes.len() {
            let mut f = Frames::from_client();
            f.pass(&bytes[..cut]);
            assert_eq!(f.at_boundary(), ends.contains(&cut), "cut at {cut}");
            f.pass(&bytes[cut..]);
            assert!(f.at_boundary());
            assert_eq!(f.last_stream(), 5);
        }
        // Writing no more than `room` at a time stops at each end.
        let mut f = Frames::from_client();
        let mut at = 0;
        let mut stops = Vec::new();
        while at < bytes.len() {
            let n = f.room().min(bytes.len() - at).min(7);
            f.pass(&bytes[at..at + n]);
            at += n;
            if f.at_boundary() {
                stops.push(at);
            }
        }
        assert_eq!(stops, ends);
    }

    #[test]
    fn a_goaway_frame_says_its_last_stream_and_code() {
        let g = goaway(5, ENHANCE_YOUR_CALM);
        assert_eq!(g[..9], [0, 0, 8, GOAWAY_FRAME, 0, 0, 0, 0, 0]);
        assert_eq!(g[9..], [0, 0, 0, 5, 0, 0, 0, 0xb]);
        let mut f = Frames::from_server();
        f.pass(&g);
        assert!(f.at_boundary());
    }
}
