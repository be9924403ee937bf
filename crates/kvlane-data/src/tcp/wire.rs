//! The tcp backend's wire format.
//!
//! Every connection starts with a challenge-response: the target sends a
//! [`Challenge`] (magic, version, 32 fresh random bytes) as soon as it
//! accepts the connection; the initiator answers with a [`Hello`] that
//! proves the credential it was issued without revealing it; the target
//! answers with [`HELLO_ACK`] or closes the connection. Then the initiator
//! sends requests and the target answers each one, in order:
//!
//! ```text
//! challenge (40 bytes)  "KVLT" | version u8 | zero [u8; 3] | nonce [u8; 32]
//! hello     (56 bytes)  "KVLT" | version u8 | zero [u8; 3] | id [u8; 16] | proof [u8; 32]
//!   id    = HMAC-SHA256(token, "kvlane-tcp/credential-id")[..16]
//!   proof = HMAC-SHA256(token, "kvlane-tcp/hello" || nonce || id)
//! hello ack (8 bytes)   "KVLT" | version u8 | zero [u8; 3]
//! request  (32 bytes, little endian)
//!   0  op      u8   1 = READ, 2 = WRITE, 3 = NOTIFY, 4 = FENCE
//!   1  zero    [u8; 3]
//!   4  key     u32  (zero for NOTIFY and FENCE)
//!   8  tag     u64  echoed in the response
//!   16 offset  u64  FENCE: the connection's generation
//!   24 len     u64  WRITE and NOTIFY: that many payload bytes follow (FENCE: zero)
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
//! **Fences.** An initiator's first request on every connection is a
//! FENCE naming the connection's generation: a number that grows with
//! every connection set (every connect, reconnect or fence) the initiator
//! opens to this target. The target keeps, per peer, the highest
//! generation fenced so far; once a FENCE of generation `g` is answered,
//! no WRITE byte and no notification of a connection of a lower
//! generation reaches memory or the application (the target checks before
//! each write into memory and closes such a connection). A FENCE below the
//! peer's current generation closes its own connection. So an initiator
//! that reports a transfer failed only after a newer generation was fenced
//! knows that no byte of the failed attempt still in the network (in a
//! proxy, in the target's socket buffer) lands later, over newer data.
//!
//! A target whose address cannot be reached can be fenced through another
//! tcp backend of its process (another rail of the same agent, linked with
//! `TcpBackend::fence_through_each_other`): a connection there presents
//! the unreachable rail's credential, is admitted for FENCE only (any
//! other request closes it), and raises that rail's fence for the peer.
//!
//! A header that does not decode ([`FrameError`]) ends the connection: the
//! stream cannot be resynchronised. A request that decodes but is refused
//! by the target's checks is answered with a status and the connection
//! stays up (a refused WRITE's payload is read and discarded).
//!
//! The token (the credential, issued per peer by the target) never crosses
//! a data connection: the `id` names it (a one-way function of it), the
//! `proof` holds only for this connection's nonce. A hello recorded on one
//! connection and replayed on another is refused, since the target's
//! nonce differs. This protects the credential from an observer of the
//! data connections; what an observer of the endpoint exchange sees is
//! the control plane's business (the facade seals endpoints under the
//! key-derived session secret when a pre-shared key is configured).
//! Nothing here encrypts or authenticates the requests and payloads that
//! follow the hello.

use crate::ids::RemoteKey;
use crate::transfer::Op;

/// First bytes of a [`Hello`] and of [`HELLO_ACK`].
pub const MAGIC: [u8; 4] = *b"KVLT";
/// Protocol version (3: connections fenced by generation; 2:
/// challenge-response hello; 1 sent the token).
pub const VERSION: u8 = 3;
/// Length of the auth token (the secret credential).
pub const TOKEN_LEN: usize = 16;
/// Length of the public id that names a credential in a [`Hello`].
pub const ID_LEN: usize = 16;
/// Length of a [`Challenge`]'s nonce.
pub const NONCE_LEN: usize = 32;
/// Length of a [`Hello`]'s proof.
pub const PROOF_LEN: usize = 32;
/// Length of an encoded [`Challenge`].
pub const CHALLENGE_LEN: usize = 8 + NONCE_LEN;
/// Length of an encoded [`Hello`].
pub const HELLO_LEN: usize = 8 + ID_LEN + PROOF_LEN;
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

type HmacSha256 = hmac::Hmac<sha2::Sha256>;

/// HMAC-SHA256 keyed with `token` over `label` and `parts`.
fn keyed(token: &[u8; TOKEN_LEN], label: &[u8], parts: &[&[u8]]) -> HmacSha256 {
    use hmac::Mac;
    // HMAC takes keys of any length: this cannot fail.
    let mut m = <HmacSha256 as Mac>::new_from_slice(token).expect("hmac takes any key length");
    m.update(label);
    for p in parts {
        m.update(p);
    }
    m
}

const ID_LABEL: &[u8] = b"kvlane-tcp/credential-id";
const PROOF_LABEL: &[u8] = b"kvlane-tcp/hello";

/// The public id of the credential `token`: what a [`Hello`] names it by.
/// A one-way function of the token (learning the id teaches nothing of
/// the token).
pub fn credential_id(token: &[u8; TOKEN_LEN]) -> [u8; ID_LEN] {
    use hmac::Mac;
    let mut id = [0u8; ID_LEN];
    id.copy_from_slice(&keyed(token, ID_LABEL, &[]).finalize().into_bytes()[..ID_LEN]);
    id
}

/// The 8-byte header of a challenge, a hello and the ack.
fn header() -> [u8; 8] {
    HELLO_ACK
}

/// Whether `b` starts with this version's header.
fn header_ok(b: &[u8]) -> bool {
    b.len() >= 8 && b[..8] == HELLO_ACK
}

/// The first message on every connection, from the target: a fresh nonce
/// the initiator's [`Hello`] must prove its credential over.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Challenge {
    /// Random bytes, fresh per connection.
    pub nonce: [u8; NONCE_LEN],
}

impl Challenge {
    /// A challenge with a fresh random nonce (`rand`'s thread-local CSPRNG,
    /// seeded by the OS).
    pub fn fresh() -> Self {
        Self {
            nonce: rand::random(),
        }
    }

    /// Encodes the challenge.
    pub fn encode(&self) -> [u8; CHALLENGE_LEN] {
        let mut b = [0u8; CHALLENGE_LEN];
        b[..8].copy_from_slice(&header());
        b[8..].copy_from_slice(&self.nonce);
        b
    }

    /// Decodes a challenge; another magic or version is a [`FrameError`]
    /// (a target of another version: [`FrameError::Version`]).
    pub fn decode(b: &[u8; CHALLENGE_LEN]) -> Result<Self, FrameError> {
        check_header(b)?;
        let mut nonce = [0u8; NONCE_LEN];
        nonce.copy_from_slice(&b[8..]);
        Ok(Self { nonce })
    }
}

/// The header check shared by challenges and hellos.
fn check_header(b: &[u8]) -> Result<(), FrameError> {
    if b[..4] != MAGIC {
        return Err(FrameError::Magic);
    }
    if b[4] != VERSION {
        return Err(FrameError::Version {
            ours: VERSION,
            theirs: b[4],
        });
    }
    if b[5..8] != [0; 3] {
        return Err(FrameError::Reserved);
    }
    Ok(())
}

/// The initiator's answer to a [`Challenge`]: which credential, and a
/// proof of it over the challenge's nonce.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hello {
    /// [`credential_id`] of the token.
    pub id: [u8; ID_LEN],
    /// HMAC-SHA256 keyed with the token over the nonce and the id.
    pub proof: [u8; PROOF_LEN],
}

impl Hello {
    /// The hello proving `token` for `challenge`.
    pub fn answer(challenge: &Challenge, token: &[u8; TOKEN_LEN]) -> Self {
        use hmac::Mac;
        let id = credential_id(token);
        let mut proof = [0u8; PROOF_LEN];
        proof.copy_from_slice(
            &keyed(token, PROOF_LABEL, &[&challenge.nonce, &id])
                .finalize()
                .into_bytes(),
        );
        Self { id, proof }
    }

    /// Encodes the hello.
    pub fn encode(&self) -> [u8; HELLO_LEN] {
        let mut b = [0u8; HELLO_LEN];
        b[..8].copy_from_slice(&header());
        b[8..8 + ID_LEN].copy_from_slice(&self.id);
        b[8 + ID_LEN..].copy_from_slice(&self.proof);
        b
    }

    /// Decodes a hello; a wrong header is a [`FrameError`].
    pub fn decode(b: &[u8; HELLO_LEN]) -> Result<Self, FrameError> {
        check_header(b)?;
        let mut id = [0u8; ID_LEN];
        id.copy_from_slice(&b[8..8 + ID_LEN]);
        let mut proof = [0u8; PROOF_LEN];
        proof.copy_from_slice(&b[8 + ID_LEN..]);
        Ok(Self { id, proof })
    }

    /// Whether this hello proves `token` for `challenge`: its id is the
    /// token's and its proof is over this very nonce. The proof comparison
    /// takes the same time whatever the bytes are.
    pub fn verify(&self, challenge: &Challenge, token: &[u8; TOKEN_LEN]) -> bool {
        use hmac::Mac;
        let id_ok = self.id == credential_id(token);
        let proof_ok = keyed(token, PROOF_LABEL, &[&challenge.nonce, &self.id])
            .verify_slice(&self.proof)
            .is_ok();
        id_ok & proof_ok
    }
}

/// The initiator's side of a connection's authentication, blocking: reads
/// the target's [`Challenge`], sends the [`Hello`] proving `token`, and
/// reads [`HELLO_ACK`]. A target of another version, or one that answers
/// anything else, is an [`io::ErrorKind::InvalidData`](std::io::ErrorKind::InvalidData)
/// error saying so.
pub fn authenticate<S: std::io::Read + std::io::Write>(
    mut s: S,
    token: &[u8; TOKEN_LEN],
) -> std::io::Result<()> {
    use std::io::{Error, ErrorKind};
    let mut c = [0u8; CHALLENGE_LEN];
    s.read_exact(&mut c[..8])?;
    if c[..8] != header() {
        let why = if c[..4] == MAGIC && c[4] != VERSION {
            format!(
                "the target speaks tcp wire version {}, this side {VERSION}",
                c[4]
            )
        } else {
            "the target did not send a challenge".to_owned()
        };
        return Err(Error::new(ErrorKind::InvalidData, why));
    }
    s.read_exact(&mut c[8..])?;
    let challenge = Challenge::decode(&c).map_err(|e| Error::new(ErrorKind::InvalidData, e))?;
    s.write_all(&Hello::answer(&challenge, token).encode())?;
    let mut ack = [0u8; HELLO_ACK.len()];
    s.read_exact(&mut ack)?;
    if !header_ok(&ack) {
        return Err(Error::new(
            ErrorKind::InvalidData,
            "unexpected answer to the hello",
        ));
    }
    Ok(())
}

/// Sends the FENCE of generation `gen` on a freshly authenticated
/// connection and waits for its answer (blocking; the socket's read
/// timeout bounds the wait). A target that closes the connection instead
/// has seen a newer generation of this peer: an
/// [`io::ErrorKind::ConnectionRefused`](std::io::ErrorKind::ConnectionRefused)
/// error saying so.
pub fn fence<S: std::io::Read + std::io::Write>(mut s: S, gen: u64) -> std::io::Result<()> {
    use std::io::{Error, ErrorKind};
    let req = Request {
        kind: RequestKind::Fence,
        key: RemoteKey(0),
        tag: gen,
        offset: gen,
        len: 0,
    };
    s.write_all(&req.encode())?;
    let mut h = [0u8; RESPONSE_LEN];
    match s.read_exact(&mut h) {
        Err(e) if e.kind() == ErrorKind::UnexpectedEof => {
            return Err(Error::new(
                ErrorKind::ConnectionRefused,
                format!("the target refused fence generation {gen}: a newer connection of this initiator fenced it"),
            ))
        }
        r => r?,
    }
    let resp = Response::decode(&h).map_err(|e| Error::new(ErrorKind::InvalidData, e))?;
    if resp.tag != gen || resp.status != Status::Ok {
        return Err(Error::new(
            ErrorKind::InvalidData,
            format!("unexpected answer to fence generation {gen}: {resp:?}"),
        ));
    }
    Ok(())
}

/// The target's side of [`fence`], for targets written by hand (test
/// fakes, tools): reads the FENCE an initiator sends first on every
/// connection and answers it; returns its generation. Anything else is an
/// [`io::ErrorKind::InvalidData`](std::io::ErrorKind::InvalidData) error.
pub fn answer_fence<S: std::io::Read + std::io::Write>(mut s: S) -> std::io::Result<u64> {
    use std::io::{Error, ErrorKind};
    let mut h = [0u8; REQUEST_LEN];
    s.read_exact(&mut h)?;
    let req = Request::decode(&h).map_err(|e| Error::new(ErrorKind::InvalidData, e))?;
    if req.kind != RequestKind::Fence {
        return Err(Error::new(
            ErrorKind::InvalidData,
            format!("expected a FENCE first, got {req:?}"),
        ));
    }
    s.write_all(
        &Response {
            status: Status::Ok,
            tag: req.tag,
        }
        .encode(),
    )?;
    Ok(req.offset)
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
    /// Fence the peer's connections of generations below `offset` (see
    /// the [module docs](self)); this connection is of generation `offset`.
    Fence,
}

impl RequestKind {
    /// The one-sided operation, if this is one.
    pub fn op(self) -> Option<Op> {
        match self {
            Self::Read => Some(Op::Read),
            Self::Write => Some(Op::Write),
            Self::Notify | Self::Fence => None,
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
    /// A fence carried a key.
    #[error("fence with a key")]
    BadFence,
    /// A challenge or hello that does not start with the magic bytes.
    #[error("not a kvlane tcp handshake (wrong magic)")]
    Magic,
    /// A challenge or hello of another protocol version.
    #[error("tcp wire version {theirs}, this side speaks {ours}")]
    Version {
        /// This side's version.
        ours: u8,
        /// The other side's.
        theirs: u8,
    },
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
            RequestKind::Fence => 4,
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
            4 => RequestKind::Fence,
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
            RequestKind::Fence => {
                if req.key.0 != 0 {
                    return Err(FrameError::BadFence);
                }
                0
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
            RequestKind::Read | RequestKind::Fence => 0,
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
    fn hello_checks_every_byte_and_the_nonce() {
        let token = [9u8; TOKEN_LEN];
        let challenge = Challenge::fresh();
        assert_eq!(Challenge::decode(&challenge.encode()), Ok(challenge));
        let hello = Hello::answer(&challenge, &token);
        let bytes = hello.encode();
        assert_eq!(Hello::decode(&bytes), Ok(hello));
        assert!(hello.verify(&challenge, &token));
        // Neither the id nor the proof reveals the token.
        assert!(!bytes.windows(TOKEN_LEN).any(|w| w == token));
        for i in 0..HELLO_LEN {
            let mut bad = bytes;
            bad[i] ^= 0x40;
            let ok = Hello::decode(&bad).is_ok_and(|h| h.verify(&challenge, &token));
            assert!(!ok, "byte {i} not checked");
        }
        // Proven for one nonce, refused for another (a replay).
        assert!(!hello.verify(&Challenge::fresh(), &token));
        let mut other = token;
        other[0] ^= 1;
        assert!(!hello.verify(&challenge, &other));
        let mut old = bytes;
        old[4] = 1;
        assert_eq!(
            Hello::decode(&old),
            Err(FrameError::Version {
                ours: VERSION,
                theirs: 1
            })
        );
    }

    #[test]
    fn authenticate_answers_the_challenge_and_names_an_old_target() {
        use std::io::Cursor;
        struct Duplex {
            input: Cursor<Vec<u8>>,
            output: Vec<u8>,
        }
        impl std::io::Read for Duplex {
            fn read(&mut self, b: &mut [u8]) -> std::io::Result<usize> {
                self.input.read(b)
            }
        }
        impl std::io::Write for Duplex {
            fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
                self.output.extend_from_slice(b);
                Ok(b.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let token = [3u8; TOKEN_LEN];
        let challenge = Challenge::fresh();
        let mut d = Duplex {
            input: Cursor::new([&challenge.encode()[..], &HELLO_ACK].concat()),
            output: Vec::new(),
        };
        authenticate(&mut d, &token).unwrap();
        let mut sent = [0u8; HELLO_LEN];
        sent.copy_from_slice(&d.output);
        assert!(Hello::decode(&sent).unwrap().verify(&challenge, &token));
        // A version-1 target answers nothing before a hello; one that
        // sends a challenge of another version is named.
        let mut c = challenge.encode();
        c[4] = 1;
        let mut d = Duplex {
            input: Cursor::new(c.to_vec()),
            output: Vec::new(),
        };
        let e = authenticate(&mut d, &token).unwrap_err();
        assert!(e.to_string().contains("version 1"), "{e}");
        assert!(d.output.is_empty(), "nothing was sent to it");
    }
}
