//! Wire protocol: msgpack maps with named fields, one message per frame.
//!
//! Every message carries `type` (string tag) and `version`. Unknown fields are
//! ignored; unknown types are reported as [`WireError::UnknownType`] so the
//! caller can drop and count them. The handshake is:
//!
//! ```text
//! no key:   hello(identity, blob)  -> hello_ack(identity, blob)
//! with key: hello(nonce_c)         -> hello_ack(nonce_s, mac_s)
//!           auth(mac_c, identity_c, blob_c) -> auth_ack(mac_a, identity_s, blob_s)
//! ```
//!
//! With a key, nothing but what the proof needs crosses before the key is
//! proven: a keyed `hello` and `hello_ack` carry the protocol version and a
//! nonce (their identity fields are empty). The acceptor proves the key
//! first (`mac_s`); the initiator sends its identity and blob only after
//! checking `mac_s`, and the acceptor sends its own only after checking
//! `mac_c`. `mac_c` and `mac_a` cover the handshake transcript: both nonces,
//! both identities and both blobs, so neither side can be fed a spliced
//! identity or blob.
//!
//! With `H(label, fields…) = HMAC-SHA256(key, label || (len_u64_be || field)…)`:
//! `mac_s = H("kvlane-control/acceptor!", nonce_c, nonce_s)`,
//! `mac_c = H("kvlane-control/initiator", nonce_c, nonce_s, identity_c, blob_c, source_c)`,
//! `mac_a = H("kvlane-control/acceptor2", nonce_c, nonce_s, identity_c, blob_c, source_c, identity_s, blob_s)`,
//! where an identity is its msgpack encoding (an array, see [`Identity`])
//! and `source_c` the UTF-8 of `auth.source` (empty when absent);
//! nonces are exactly 32 bytes (any other length is refused); an
//! empty key is refused by [`Config::validate`](crate::Config::validate).
//!
//! Both sides then derive the session secret
//! `S = H("kvlane-control/session-k", <the fields of mac_a>)`
//! ([`RemoteInfo::session`](crate::RemoteInfo::session)): fresh per
//! handshake, and computable only with the key. The facade seals what it
//! exchanges after the handshake under it (the data-plane endpoints, see
//! [`SessionKey`](crate::SessionKey)).
//!
//! Reflection: every key holder can compute every proof, so a proof says
//! "some key holder", not "not me". A node dialing a keyless attacker
//! would otherwise accept its own acceptor's `mac_s` (the attacker sends
//! the node's `hello` to the node's listener and relays the answer) and
//! send its identity and blob to the attacker. So a nonce names its maker
//! to key holders only: `nonce = r || H("kvlane-control/nonce-tag", r,
//! identity)[..16]` with 16 random bytes `r` and the maker's own identity.
//! An acceptor refuses a `hello` whose nonce it made itself, a dialer a
//! `hello_ack` whose `nonce_s` it made itself (`mac_s` covers `nonce_s`,
//! so the tag cannot be swapped), and both refuse an `auth` / `auth_ack`
//! carrying their own identity, with
//! [`Refusal::Reflected`](crate::Refusal::Reflected). Peers that send
//! random nonces (older builds) interoperate: the tag is only checked
//! against one's own identity. Not covered: a relay between two
//! *different* key holders (the proofs authenticate, they do not
//! encrypt: whoever relays sees what a passive observer of the link sees).
//!
//! Fields per `type` (every message also has `type: str` and `version: int`;
//! `bin` is msgpack bin, Python `bytes`):
//!
//! | type | fields |
//! |---|---|
//! | `hello` | `engine_id: str, incarnation: u64, dp_rank, tp_rank, tp_size: u32, fingerprint: str, capabilities: [str], auth: bool, nonce: bin, data_plane: bin \| nil` |
//! | `hello_ack` | the same identity fields, `nonce: bin, mac: bin, data_plane: bin \| nil` |
//! | `auth` | `mac: bin, data_plane: bin, identity: map, source: str \| absent` |
//! | `auth_ack` | `mac: bin, data_plane: bin, identity: map` |
//! | `ping`, `pong` | `seq: u64, incarnation: u64` (a pong echoes the ping's `seq`) |
//! | `notify` | `transfer_id: u64, payload: bin` |
//! | `bye` | (none; answered by a `bye`) |
//! | `error` | `code: str, reason: str` |
//!
//! A Python peer is in `tests/py/peer.py` (pyzmq DEALER + msgpack).

use serde::{Deserialize, Serialize};

use crate::error::WireError;
use crate::ids::Ranks;

/// Protocol version spoken by this crate (2: the MACs cover `auth.source`,
/// and a keyed session derives a secret; 1 left `source` outside them).
pub const PROTOCOL_VERSION: u16 = 2;

/// `hello`: the initiator's half of the handshake.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello {
    /// Protocol version.
    pub version: u16,
    /// Who the sender is, in flat fields (empty when keyed: then it is
    /// sent in `auth` / `auth_ack`).
    #[serde(flatten)]
    pub identity: Identity,
    /// Whether the sender authenticates with a pre-shared key.
    #[serde(default)]
    pub auth: bool,
    /// Sender nonce (used with a key).
    #[serde(default, with = "serde_bytes")]
    pub nonce: Vec<u8>,
    /// Data-plane blob; absent when a key is used.
    #[serde(default)]
    pub data_plane: Option<serde_bytes::ByteBuf>,
    /// The sender's IP address towards the acceptor (where a data plane it
    /// advertised on a wildcard address can be dialed back).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,
}

/// `hello_ack`: the acceptor's half.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HelloAck {
    /// Protocol version.
    pub version: u16,
    /// Who the sender is, in flat fields (empty when keyed: then it is
    /// sent in `auth` / `auth_ack`).
    #[serde(flatten)]
    pub identity: Identity,
    /// Acceptor nonce (with a key).
    #[serde(default, with = "serde_bytes")]
    pub nonce: Vec<u8>,
    /// Acceptor proof of the key (with a key).
    #[serde(default, with = "serde_bytes")]
    pub mac: Vec<u8>,
    /// Data-plane blob; absent when a key is used.
    #[serde(default)]
    pub data_plane: Option<serde_bytes::ByteBuf>,
}

/// Who a side is: what a keyed handshake sends only after the key is proven
/// (and an unkeyed one sends in the flat fields of `hello` / `hello_ack`).
/// The one home of a node's identity: [`LocalInfo`](crate::LocalInfo) holds
/// ours, [`RemoteInfo`](crate::RemoteInfo) a peer's. The ranks stay flat
/// fields (see [`ranks`](Self::ranks)) because the transcript is a msgpack
/// array in field order.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Identity {
    /// Engine id.
    pub engine_id: String,
    /// Random per process start.
    pub incarnation: u64,
    /// Data-parallel rank.
    pub dp_rank: u32,
    /// Tensor-parallel rank.
    pub tp_rank: u32,
    /// Tensor-parallel size.
    pub tp_size: u32,
    /// Config fingerprint.
    pub fingerprint: String,
    /// Capability names.
    #[serde(default)]
    pub capabilities: Vec<String>,
}

impl Identity {
    /// The ranks part.
    pub fn ranks(&self) -> Ranks {
        Ranks {
            dp_rank: self.dp_rank,
            tp_rank: self.tp_rank,
            tp_size: self.tp_size,
        }
    }

    /// The bytes the handshake MAC covers: a msgpack array (field order, no
    /// names), so both sides compute it the same way.
    pub fn transcript_bytes(&self) -> Vec<u8> {
        rmp_serde::to_vec(self).unwrap_or_default()
    }
}

impl HelloAck {
    /// A `hello_ack` carrying `identity` in its flat fields.
    fn with_identity(identity: Identity) -> Self {
        Self {
            version: PROTOCOL_VERSION,
            identity,
            nonce: Vec::new(),
            mac: Vec::new(),
            data_plane: None,
        }
    }

    /// An unkeyed `hello_ack`: identity and blob.
    pub fn plain(identity: Identity, data_plane: Vec<u8>) -> Self {
        Self {
            data_plane: Some(serde_bytes::ByteBuf::from(data_plane)),
            ..Self::with_identity(identity)
        }
    }

    /// A keyed `hello_ack`: the nonce and the proof, nothing else.
    pub fn keyed(nonce: Vec<u8>, mac: Vec<u8>) -> Self {
        Self {
            nonce,
            mac,
            ..Self::with_identity(Identity::default())
        }
    }
}

impl Hello {
    /// A `hello` carrying `identity` in its flat fields; keyed (`nonce` set)
    /// it carries neither identity nor blob nor source.
    pub fn new(
        identity: Identity,
        nonce: Option<Vec<u8>>,
        data_plane: Vec<u8>,
        source: Option<String>,
    ) -> Self {
        let keyed = nonce.is_some();
        Self {
            version: PROTOCOL_VERSION,
            identity: if keyed { Identity::default() } else { identity },
            auth: keyed,
            nonce: nonce.unwrap_or_default(),
            data_plane: (!keyed).then(|| serde_bytes::ByteBuf::from(data_plane)),
            source: if keyed { None } else { source },
        }
    }
}

/// `auth`: initiator proof of the key, then its identity and blob.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Auth {
    /// Protocol version.
    pub version: u16,
    /// Initiator proof of the key over the transcript so far.
    #[serde(with = "serde_bytes")]
    pub mac: Vec<u8>,
    /// Initiator data-plane blob.
    #[serde(with = "serde_bytes")]
    pub data_plane: Vec<u8>,
    /// Initiator identity.
    #[serde(default)]
    pub identity: Identity,
    /// The initiator's IP address towards the acceptor (see [`Hello::source`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,
}

/// `auth_ack`: acceptor identity and blob after it checked the initiator proof.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AuthAck {
    /// Protocol version.
    pub version: u16,
    /// Acceptor proof of the key over the whole transcript.
    #[serde(default, with = "serde_bytes")]
    pub mac: Vec<u8>,
    /// Acceptor data-plane blob.
    #[serde(with = "serde_bytes")]
    pub data_plane: Vec<u8>,
    /// Acceptor identity.
    #[serde(default)]
    pub identity: Identity,
}

/// `ping` / `pong`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ping {
    /// Protocol version.
    pub version: u16,
    /// Sequence number, echoed by the pong.
    pub seq: u64,
    /// Incarnation of the sender.
    pub incarnation: u64,
}

/// `notify`: a transfer notification.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Notify {
    /// Protocol version.
    pub version: u16,
    /// Transfer id.
    pub transfer_id: u64,
    /// Opaque payload.
    #[serde(with = "serde_bytes")]
    pub payload: Vec<u8>,
}

/// `bye`: orderly close.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Bye {
    /// Protocol version.
    pub version: u16,
}

/// `error`: refusal with a code and a human reason.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorMsg {
    /// Protocol version.
    pub version: u16,
    /// Stable code (`version_mismatch`, `fingerprint_mismatch`, `auth_failed`, `bad_engine_id`, `peer_cap`, ...).
    pub code: String,
    /// Human-readable reason naming both values.
    pub reason: String,
}

/// One control-plane message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
#[non_exhaustive]
pub enum Message {
    /// See [`Hello`].
    Hello(Hello),
    /// See [`HelloAck`].
    HelloAck(HelloAck),
    /// See [`Auth`].
    Auth(Auth),
    /// See [`AuthAck`].
    AuthAck(AuthAck),
    /// Keep-alive request.
    Ping(Ping),
    /// Keep-alive answer.
    Pong(Ping),
    /// See [`Notify`].
    Notify(Notify),
    /// See [`Bye`].
    Bye(Bye),
    /// See [`ErrorMsg`].
    Error(ErrorMsg),
}

impl Message {
    /// The `type` tag.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Hello(_) => "hello",
            Self::HelloAck(_) => "hello_ack",
            Self::Auth(_) => "auth",
            Self::AuthAck(_) => "auth_ack",
            Self::Ping(_) => "ping",
            Self::Pong(_) => "pong",
            Self::Notify(_) => "notify",
            Self::Bye(_) => "bye",
            Self::Error(_) => "error",
        }
    }

    /// Encodes as a msgpack map with named fields.
    pub fn encode(&self) -> Result<Vec<u8>, WireError> {
        rmp_serde::to_vec_named(self).map_err(|e| WireError::Encode {
            reason: e.to_string(),
        })
    }

    /// Decodes one frame, refusing frames over `cap` bytes. Never panics.
    pub fn decode(bytes: &[u8], cap: usize) -> Result<Self, WireError> {
        if bytes.len() > cap {
            return Err(WireError::Oversized {
                len: bytes.len(),
                cap,
            });
        }
        let env: Envelope = from_slice(bytes)?;
        if env.version != PROTOCOL_VERSION && env.kind != "error" && env.kind != "hello" {
            return Err(WireError::VersionMismatch {
                local: PROTOCOL_VERSION,
                remote: env.version,
            });
        }
        Ok(match env.kind.as_str() {
            "hello" => Self::Hello(from_slice(bytes)?),
            "hello_ack" => Self::HelloAck(from_slice(bytes)?),
            "auth" => Self::Auth(from_slice(bytes)?),
            "auth_ack" => Self::AuthAck(from_slice(bytes)?),
            "ping" => Self::Ping(from_slice(bytes)?),
            "pong" => Self::Pong(from_slice(bytes)?),
            "notify" => Self::Notify(from_slice(bytes)?),
            "bye" => Self::Bye(from_slice(bytes)?),
            "error" => Self::Error(from_slice(bytes)?),
            _ => return Err(WireError::UnknownType { kind: env.kind }),
        })
    }
}

#[derive(Deserialize)]
struct Envelope {
    #[serde(rename = "type")]
    kind: String,
    version: u16,
}

fn from_slice<'a, T: Deserialize<'a>>(bytes: &'a [u8]) -> Result<T, WireError> {
    rmp_serde::from_slice(bytes).map_err(|e| WireError::Malformed {
        reason: e.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roundtrip_and_named_fields() {
        let m = Message::Ping(Ping {
            version: PROTOCOL_VERSION,
            seq: 7,
            incarnation: 9,
        });
        let bytes = m.encode().expect("encode");
        // Named map: the keys are in the bytes.
        assert!(bytes.windows(4).any(|w| w == b"type"));
        assert!(bytes.windows(3).any(|w| w == b"seq"));
        assert_eq!(Message::decode(&bytes, 1024).expect("decode"), m);
    }

    #[test]
    fn unknown_type_and_fields() {
        #[derive(Serialize)]
        struct Odd {
            #[serde(rename = "type")]
            kind: &'static str,
            version: u16,
            seq: u64,
            incarnation: u64,
            extra: &'static str,
        }
        let odd = Odd {
            kind: "ping",
            version: PROTOCOL_VERSION,
            seq: 1,
            incarnation: 2,
            extra: "x",
        };
        let bytes = rmp_serde::to_vec_named(&odd).expect("encode");
        assert!(matches!(
            Message::decode(&bytes, 1024),
            Ok(Message::Ping(_))
        ));
        let odd = Odd {
            kind: "teleport",
            ..odd
        };
        let bytes = rmp_serde::to_vec_named(&odd).expect("encode");
        assert_eq!(
            Message::decode(&bytes, 1024),
            Err(WireError::UnknownType {
                kind: "teleport".into()
            })
        );
        assert!(matches!(
            Message::decode(&bytes, 3),
            Err(WireError::Oversized { .. })
        ));
    }
}
