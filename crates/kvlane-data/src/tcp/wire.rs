//! The tcp backend's wire format.
//!
//! Every connection starts with a [`Hello`] from the initiator (magic,
//! version, the target's 128-bit token); the target answers with
//! [`HELLO_ACK`] or closes the connection. Then the initiator sends
//! requests and the target answers each one, in order:
//!
//! ```text
//! request  (32 bytes, little endian)
//!   0  op      u8   1 = READ, 2 = WRITE, 3 = NOTIFY
//!   1  zero    [u8; 3]
//!   4  key     u32
//!   8  tag     u64  echoed in the response
//!   16 offset  u64
//!   24 len     u64  WRITE and NOTIFY: that many payload bytes follow
//! response (24 bytes)
//!   0  status  u8   0 = ok, 1 = unknown key, 2 = out of bounds, 3 = access denied,
//!                   4 = notification queue full (NOTIFY only)
//!   1  zero    [u8; 7]
//!   8  tag     u64
//!   16 aux     u64  region length (out of bounds) or granted access bits
//!                   (access denied); a successful READ is followed by
//!                   `len` payload bytes
//! ```
//!
//! A header that does not decode ([`FrameError`]) ends the connection: the
//! stream cannot be resynchronised. A request that decodes but is refused
//! by the target's checks is answered with a status and the connection
//! stays up (a refused WRITE's payload is read and discarded).

use crate::ids::RemoteKey;
use crate::transfer::Op;

/// First bytes of a [`Hello`] and of [`HELLO_ACK`].
pub const MAGIC: [u8; 4] = *b"KVLT";
/// Protocol version.
pub const VERSION: u8 = 1;
/// Length of the auth token.
pub const TOKEN_LEN: usize = 16;
/// Length of an encoded [`Hello`].
pub const HELLO_LEN: usize = 24;
/// The target's answer to an accepted [`Hello`].
pub const HELLO_ACK: [u8; 8] = [b'K', b'V', b'L', b'T', VERSION, 0, 0, 0];
/// Length of an encoded [`Request`] header.
pub const REQUEST_LEN: usize = 32;
/// Length of an encoded [`Response`] header.
pub const RESPONSE_LEN: usize = 24;
/// Largest READ or WRITE a single request may move (the initiator splits
/// larger spans into chunks of at most this size).
pub const MAX_CHUNK: u64 = 64 << 20;
/// Largest notification payload.
pub const MAX_NOTIFY: u64 = 64 << 10;

/// The first message on every connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hello {
    /// The target's token, learned from its endpoint.
    pub token: [u8; TOKEN_LEN],
}

impl Hello {
    /// Encodes the hello.
    pub fn encode(&self) -> [u8; HELLO_LEN] {
        let mut b = [0u8; HELLO_LEN];
        b[..4].copy_from_slice(&MAGIC);
        b[4] = VERSION;
        b[8..].copy_from_slice(&self.token);
        b
    }

    /// Whether `bytes` is a hello carrying `token`. The token comparison
    /// takes the same time whatever the bytes are.
    pub fn verify(bytes: &[u8; HELLO_LEN], token: &[u8; TOKEN_LEN]) -> bool {
        let mut diff = 0u8;
        for (a, b) in bytes[8..].iter().zip(token) {
            diff |= a ^ b;
        }
        let header_ok = bytes[..4] == MAGIC && bytes[4] == VERSION && bytes[5..8] == [0; 3];
        // Both parts are always computed; `black_box` keeps the compiler
        // from turning the token loop into an early exit.
        std::hint::black_box(diff) == 0 && header_ok
    }
}

/// What a request asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RequestKind {
    /// Send `len` bytes of the region back.
    Read,
    /// Store the `len` payload bytes that follow.
    Write,
    /// Deliver the `len` payload bytes that follow as a notification.
    Notify,
}

impl RequestKind {
    /// The one-sided operation, if this is one.
    pub fn op(self) -> Option<Op> {
        match self {
            Self::Read => Some(Op::Read),
            Self::Write => Some(Op::Write),
            Self::Notify => None,
        }
    }
}

/// A request header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Request {
    /// What to do.
    pub kind: RequestKind,
    /// Region key (zero for notifications).
    pub key: RemoteKey,
    /// Initiator's tag, echoed in the response.
    pub tag: u64,
    /// Offset in the region (zero for notifications).
    pub offset: u64,
    /// Bytes to move.
    pub len: u64,
}

/// Why a header could not be decoded; the connection is closed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FrameError {
    /// Unknown opcode or status byte.
    #[error("unknown opcode or status {0}")]
    BadCode(u8),
    /// Reserved bytes were not zero.
    #[error("reserved header bytes are not zero")]
    Reserved,
    /// The length exceeds the protocol's limit.
    #[error("length {len} exceeds the limit of {max}")]
    TooLong {
        /// Requested length.
        len: u64,
        /// The limit.
        max: u64,
    },
    /// A notification carried a key or offset.
    #[error("notification with a key or offset")]
    BadNotify,
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(a)
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}

impl Request {
    /// Encodes the header.
    pub fn encode(&self) -> [u8; REQUEST_LEN] {
        let mut b = [0u8; REQUEST_LEN];
        b[0] = match self.kind {
            RequestKind::Read => 1,
            RequestKind::Write => 2,
            RequestKind::Notify => 3,
        };
        b[4..8].copy_from_slice(&self.key.0.to_le_bytes());
        b[8..16].copy_from_slice(&self.tag.to_le_bytes());
        b[16..24].copy_from_slice(&self.offset.to_le_bytes());
        b[24..32].copy_from_slice(&self.len.to_le_bytes());
        b
    }

    /// Decodes a header; any malformed field is a [`FrameError`].
    pub fn decode(b: &[u8; REQUEST_LEN]) -> Result<Self, FrameError> {
        let kind = match b[0] {
            1 => RequestKind::Read,
            2 => RequestKind::Write,
            3 => RequestKind::Notify,
            other => return Err(FrameError::BadCode(other)),
        };
        if b[1..4] != [0; 3] {
            return Err(FrameError::Reserved);
        }
        let req = Self {
            kind,
            key: RemoteKey(u32_at(b, 4)),
            tag: u64_at(b, 8),
            offset: u64_at(b, 16),
            len: u64_at(b, 24),
        };
        let max = match kind {
            RequestKind::Notify => {
                if req.key.0 != 0 || req.offset != 0 {
                    return Err(FrameError::BadNotify);
                }
                MAX_NOTIFY
            }
            _ => MAX_CHUNK,
        };
        if req.len > max {
            return Err(FrameError::TooLong { len: req.len, max });
        }
        Ok(req)
    }

    /// Payload bytes that follow this header on the wire.
    pub fn payload_len(&self) -> u64 {
        match self.kind {
            RequestKind::Read => 0,
            RequestKind::Write | RequestKind::Notify => self.len,
        }
    }
}

/// How the target answered a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Status {
    /// Done (a READ's bytes follow).
    Ok,
    /// No region under the key.
    UnknownKey,
    /// The range is outside the region; carries the region's length.
    OutOfBounds(u64),
    /// The region lacks the remote right; carries the granted access bits.
    AccessDenied(u8),
    /// A NOTIFY was refused: the target's queue of notifications its
    /// application has not taken yet is full. The payload was read and
    /// dropped; the data of the transfer it belongs to has landed.
    NotifyQueueFull,
    /// A WRITE was cut: its region was deregistered while its payload
    /// was arriving. Part of the payload may have landed; the rest was
    /// read and dropped.
    Revoked,
}

/// A response header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Response {
    /// The outcome.
    pub status: Status,
    /// The request's tag.
    pub tag: u64,
}

impl Response {
    /// Encodes the header.
    pub fn encode(&self) -> [u8; RESPONSE_LEN] {
        let mut b = [0u8; RESPONSE_LEN];
        let (code, aux) = match self.status {
            Status::Ok => (0, 0),
            Status::UnknownKey => (1, 0),
            Status::OutOfBounds(len) => (2, len),
            Status::AccessDenied(bits) => (3, u64::from(bits)),
            Status::NotifyQueueFull => (4, 0),
            Status::Revoked => (5, 0),
        };
        b[0] = code;
        b[8..16].copy_from_slice(&self.tag.to_le_bytes());
        b[16..24].copy_from_slice(&aux.to_le_bytes());
        b
    }

    /// Decodes a header.
    pub fn decode(b: &[u8; RESPONSE_LEN]) -> Result<Self, FrameError> {
        if b[1..8] != [0; 7] {
            return Err(FrameError::Reserved);
        }
        let aux = u64_at(b, 16);
        let status = match b[0] {
            0 => Status::Ok,
            1 => Status::UnknownKey,
            2 => Status::OutOfBounds(aux),
            // Only the low byte carries access bits.
            3 => Status::AccessDenied(aux.to_le_bytes()[0]),
            4 => Status::NotifyQueueFull,
            5 => Status::Revoked,
            other => return Err(FrameError::BadCode(other)),
        };
        Ok(Self {
            status,
            tag: u64_at(b, 8),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_roundtrip() {
        for kind in [RequestKind::Read, RequestKind::Write] {
            let r = Request {
                kind,
                key: RemoteKey(7),
                tag: 99,
                offset: u64::MAX - 3,
                len: MAX_CHUNK,
            };
            assert_eq!(Request::decode(&r.encode()), Ok(r));
        }
        for status in [
            Status::Ok,
            Status::UnknownKey,
            Status::OutOfBounds(12345),
            Status::AccessDenied(2),
            Status::NotifyQueueFull,
            Status::Revoked,
        ] {
            let r = Response { status, tag: 5 };
            assert_eq!(Response::decode(&r.encode()), Ok(r));
        }
    }

    #[test]
    fn malformed_headers_are_framing_errors() {
        let mut b = [0u8; REQUEST_LEN];
        assert_eq!(Request::decode(&b), Err(FrameError::BadCode(0)));
        b[0] = 2;
        b[2] = 1;
        assert_eq!(Request::decode(&b), Err(FrameError::Reserved));
        b[2] = 0;
        b[24..32].copy_from_slice(&(MAX_CHUNK + 1).to_le_bytes());
        assert!(matches!(
            Request::decode(&b),
            Err(FrameError::TooLong { .. })
        ));
        b[0] = 3;
        b[24..32].copy_from_slice(&1u64.to_le_bytes());
        b[4] = 1;
        assert_eq!(Request::decode(&b), Err(FrameError::BadNotify));
        // Status codes past the last one are framing errors.
        let mut r = [0u8; RESPONSE_LEN];
        for code in [6u8, 0x80, 0xff] {
            r[0] = code;
            assert_eq!(Response::decode(&r), Err(FrameError::BadCode(code)));
        }
    }

    #[test]
    fn hello_checks_every_token_byte() {
        let token = [9u8; TOKEN_LEN];
        let hello = Hello { token }.encode();
        assert!(Hello::verify(&hello, &token));
        for i in 0..HELLO_LEN {
            let mut bad = hello;
            bad[i] ^= 0x40;
            assert!(!Hello::verify(&bad, &token), "byte {i} not checked");
        }
    }
}
