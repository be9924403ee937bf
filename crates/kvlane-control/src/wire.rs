//! Wire protocol: msgpack maps with named fields, one message per frame.
//!
//! Every message carries `type` (string tag) and `version`. Unknown fields are
//! ignored; unknown types are reported as [`WireError::UnknownType`] so the
//! caller can drop and count them. The handshake is:
//!
//! ```text
//! no key:   hello(blob)            -> hello_ack(blob)
//! with key: hello(nonce_c, no blob) -> hello_ack(nonce_s, mac_s, no blob)
//!           auth(mac_c, blob)       -> auth_ack(blob)
//! ```
//!
//! With a key, the acceptor proves the key first (`mac_s`) but withholds its
//! blob; the initiator sends its blob only after checking `mac_s`, and the
//! acceptor sends its blob only after checking `mac_c`.
//!
//! `mac_s = HMAC-SHA256(key, "kvlane-control/acceptor!" || nonce_c || nonce_s)`,
//! `mac_c = HMAC-SHA256(key, "kvlane-control/initiator" || nonce_c || nonce_s)`,
//! nonces are 32 random bytes.
//!
//! Fields per `type` (every message also has `type: str` and `version: int`;
//! `bin` is msgpack bin, Python `bytes`):
//!
//! | type | fields |
//! |---|---|
//! | `hello` | `engine_id: str, incarnation: u64, dp_rank, tp_rank, tp_size: u32, fingerprint: str, capabilities: [str], auth: bool, nonce: bin, data_plane: bin \| nil` |
//! | `hello_ack` | same identity fields, `nonce: bin, mac: bin, data_plane: bin \| nil` |
//! | `auth` | `mac: bin, data_plane: bin` |
//! | `auth_ack` | `data_plane: bin` |
//! | `ping`, `pong` | `seq: u64, incarnation: u64` (a pong echoes the ping's `seq`) |
//! | `notify` | `transfer_id: u64, payload: bin` |
//! | `bye` | (none; answered by a `bye`) |
//! | `error` | `code: str, reason: str` |
//!
//! A Python peer is in `tests/py/peer.py` (pyzmq DEALER + msgpack).

use serde::{Deserialize, Serialize};

use crate::error::WireError;

/// Protocol version spoken by this crate.
pub const PROTOCOL_VERSION: u16 = 1;

/// `hello`: the initiator's half of the handshake.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello {
    /// Protocol version.
    pub version: u16,
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

/// `auth`: initiator proof of the key, then its blob.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Auth {
    /// Protocol version.
    pub version: u16,
    /// Initiator proof of the key.
    #[serde(with = "serde_bytes")]
    pub mac: Vec<u8>,
    /// Initiator data-plane blob.
    #[serde(with = "serde_bytes")]
    pub data_plane: Vec<u8>,
}

/// `auth_ack`: acceptor blob after it checked the initiator proof.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AuthAck {
    /// Protocol version.
    pub version: u16,
    /// Acceptor data-plane blob.
    #[serde(with = "serde_bytes")]
    pub data_plane: Vec<u8>,
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
    /// Stable code (`version_mismatch`, `fingerprint_mismatch`, `auth_failed`, `peer_cap`, ...).
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
            version: 1,
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
