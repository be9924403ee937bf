//! What agents send each other inside the control plane's opaque fields:
//! the data-plane description of the handshake, per-peer endpoint offers
//! and answers, and notification frames. One policy for all of them: msgpack
//! maps with named fields; an encode failure is this side's
//! [`ErrorKind::InvalidInput`], a frame from a peer that does not decode is
//! [`ErrorKind::Refused`] naming the peer.

use crate::error::{Error, ErrorKind};
use crate::events::Notification;
use bytes::Bytes;
use kvlane_control::SessionKey;
use kvlane_data::{Endpoint, KvLayout, RemoteRegion};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

/// Control-plane notification id of an endpoint offer.
pub(crate) const DP_OFFER: u64 = u64::MAX - 1;
/// Control-plane notification id of the answer to an offer.
pub(crate) const DP_ANSWER: u64 = u64::MAX - 2;

/// One KV cache as advertised in the handshake.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct KvAdvert {
    pub(crate) region: RemoteRegion,
    pub(crate) layout: KvLayout,
}

/// The data-plane blob an agent puts in its handshake.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct DataPlaneInfo {
    /// `None` when the backend needs an endpoint per peer.
    pub(crate) endpoint: Option<Endpoint>,
    pub(crate) kv: Vec<KvAdvert>,
    /// Plain regions (registered with
    /// [`AgentBuilder::register_region`](crate::AgentBuilder::register_region)),
    /// addressed by span; absent from agents that register none.
    #[serde(default)]
    pub(crate) regions: Vec<RemoteRegion>,
}

impl DataPlaneInfo {
    /// Checks what `peer` advertised before any of it is used: every KV
    /// layout is well formed (a peer's layout did not go through
    /// [`KvLayout::new`]) and fits the region advertised with it.
    pub(crate) fn check(&self, peer: &str) -> Result<(), Error> {
        for (i, kv) in self.kv.iter().enumerate() {
            kv.layout.validate().map_err(|e| {
                Error::msg(
                    ErrorKind::Refused,
                    format!("{peer} advertised KV cache {i} with an invalid layout: {e}"),
                )
            })?;
            let need = kv.layout.required_len().unwrap_or(u64::MAX);
            if need > kv.region.len {
                return Err(Error::msg(
                    ErrorKind::Refused,
                    format!(
                        "{peer} advertised KV cache {i} as {} bytes, but its layout needs {need}",
                        kv.region.len
                    ),
                ));
            }
        }
        Ok(())
    }
}

/// Offer or answer of a per-peer endpoint exchange.
///
/// An endpoint holds what reaches the sender's memory (a tcp credential),
/// so on a keyed connection it crosses only sealed under the session's
/// secret ([`SessionKey::seal`], for [`Exchange::label`]), never in the
/// clear: an observer of the control connection learns nothing usable.
/// Without a key there is nothing to seal it with, and it crosses in the
/// clear (`endpoint`).
#[derive(Debug, Default, Serialize, Deserialize)]
pub(crate) struct DpFrame {
    /// Incarnation of the sender.
    pub(crate) incarnation: u64,
    /// The sender's endpoint for this connection (unkeyed connections).
    pub(crate) endpoint: Option<Endpoint>,
    /// Why the sender could not connect (answers only).
    pub(crate) error: Option<String>,
    /// The sender's endpoint, msgpack-encoded and sealed under the session
    /// secret (keyed connections).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) sealed: Option<serde_bytes::ByteBuf>,
}

/// Which half of an endpoint exchange a [`DpFrame`] is.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Exchange {
    Offer,
    Answer,
}

impl Exchange {
    /// The seal's label: an offer never opens as an answer.
    fn label(self) -> &'static str {
        match self {
            Self::Offer => "kvlane/dp-offer",
            Self::Answer => "kvlane/dp-answer",
        }
    }

    fn what(self) -> &'static str {
        match self {
            Self::Offer => "an endpoint offer",
            Self::Answer => "an endpoint answer",
        }
    }
}

impl DpFrame {
    /// A frame carrying `endpoint`: sealed under `session` when there is
    /// one, in the clear otherwise.
    pub(crate) fn with_endpoint(
        incarnation: u64,
        endpoint: Endpoint,
        session: Option<&SessionKey>,
        exchange: Exchange,
    ) -> Result<Self, Error> {
        Ok(match session {
            Some(key) => {
                let plain = encode(exchange.what(), &endpoint)?;
                Self {
                    incarnation,
                    sealed: Some(serde_bytes::ByteBuf::from(
                        key.seal(exchange.label(), &plain),
                    )),
                    ..Self::default()
                }
            }
            None => Self {
                incarnation,
                endpoint: Some(endpoint),
                ..Self::default()
            },
        })
    }

    /// The endpoint `peer` sent, opened under `session`. A keyed
    /// connection takes only a sealed endpoint (one in the clear was
    /// visible to anybody on the way), an unkeyed one only a clear one.
    pub(crate) fn open(
        &self,
        session: Option<&SessionKey>,
        peer: &str,
        exchange: Exchange,
    ) -> Result<Option<Endpoint>, Error> {
        let refused = |msg: String| Error::msg(ErrorKind::Refused, msg);
        let what = exchange.what();
        match (session, &self.sealed, &self.endpoint) {
            (Some(key), Some(sealed), _) => {
                let plain = key
                    .open(exchange.label(), sealed)
                    .map_err(|e| refused(format!("{peer} sent {what} that does not open: {e}")))?;
                decode(what, peer, &plain).map(Some)
            }
            (Some(_), None, Some(_)) => Err(refused(format!(
                "{peer} sent {what} in the clear on a keyed connection (an older kvlane?): \
                 refused, since anybody on the way could have read its credential"
            ))),
            (None, Some(_), _) => Err(refused(format!(
                "{peer} sent a sealed {what} but this connection has no key to open it"
            ))),
            (_, None, endpoint) => Ok(endpoint.clone()),
        }
    }
}

/// A notification on the wire (data plane or control plane): who sent
/// it, then the payload.
#[derive(Serialize, Deserialize)]
pub(crate) struct NotifyFrame {
    pub(crate) from: String,
    #[serde(with = "serde_bytes")]
    pub(crate) payload: Vec<u8>,
}

/// Encodes a frame; `what` names it in the error.
pub(crate) fn encode<T: Serialize>(what: &str, frame: &T) -> Result<Vec<u8>, Error> {
    rmp_serde::to_vec_named(frame)
        .map_err(|e| Error::msg(ErrorKind::InvalidInput, format!("encode {what}: {e}")))
}

/// Decodes a frame `peer` sent; `what` names it in the error.
pub(crate) fn decode<T: DeserializeOwned>(
    what: &str,
    peer: &str,
    bytes: &[u8],
) -> Result<T, Error> {
    rmp_serde::from_slice(bytes).map_err(|e| {
        Error::msg(
            ErrorKind::Refused,
            format!("{peer} sent {what} that does not decode: {e}"),
        )
    })
}

/// The notification frame of `from` carrying `payload`.
pub(crate) fn notify_frame(from: &str, payload: &[u8]) -> Result<Vec<u8>, Error> {
    encode(
        "a notification",
        &NotifyFrame {
            from: from.to_owned(),
            payload: payload.to_vec(),
        },
    )
}

/// A received notification: a [`NotifyFrame`] names its sender; any other
/// payload (a peer that is not a kvlane agent) is delivered as it is, from
/// `sender` — nothing is dropped.
pub(crate) fn notification(payload: Vec<u8>, sender: impl FnOnce() -> String) -> Notification {
    match rmp_serde::from_slice::<NotifyFrame>(&payload) {
        Ok(f) => Notification {
            from: f.from,
            payload: Bytes::from(f.payload),
        },
        Err(_) => Notification {
            from: sender(),
            payload: Bytes::from(payload),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn notification_frames_round_trip_and_foreign_payloads_are_kept() {
        let frame = notify_frame("prefill-0", b"req-17").unwrap();
        let n = notification(frame, || unreachable!("the frame names its sender"));
        assert_eq!(
            (n.from.as_str(), &n.payload[..]),
            ("prefill-0", &b"req-17"[..])
        );
        let n = notification(b"raw".to_vec(), || "peer at 10.0.0.2:5555".into());
        assert_eq!(
            (n.from.as_str(), &n.payload[..]),
            ("peer at 10.0.0.2:5555", &b"raw"[..])
        );
    }

    fn advert(layout: KvLayout, len: u64) -> DataPlaneInfo {
        DataPlaneInfo {
            endpoint: None,
            regions: Vec::new(),
            kv: vec![KvAdvert {
                region: RemoteRegion {
                    key: kvlane_data::RemoteKey(1),
                    addr: 0x1000,
                    len,
                    access: kvlane_data::Access::ALL,
                },
                layout,
            }],
        }
    }

    #[test]
    fn a_peers_layout_is_checked_before_use() {
        let good = KvLayout::new(
            2,
            4,
            4096,
            kvlane_data::KvParts::Fused,
            kvlane_data::LayoutOrder::LayerMajor,
        )
        .unwrap();
        let need = good.required_len().unwrap();
        advert(good, need).check("p:1").unwrap();
        let short = advert(good, need - 1).check("p:1").unwrap_err();
        assert_eq!(short.kind(), ErrorKind::Refused);
        assert!(
            short.to_string().contains("p:1") && short.to_string().contains(&need.to_string()),
            "{short}"
        );
        // Layouts a hostile peer can send: no layers, overlapping blocks,
        // strides that overflow.
        let zero = KvLayout {
            num_layers: 0,
            ..good
        };
        let overlap = KvLayout {
            block_stride: 1,
            ..good
        };
        let huge = KvLayout {
            layer_stride: u64::MAX,
            ..good
        };
        for bad in [zero, overlap, huge] {
            let e = advert(bad, u64::MAX).check("p:1").unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Refused, "{bad:?}");
            assert!(e.to_string().contains("invalid layout"), "{e}");
        }
    }

    /// A keyed connection's endpoint crosses sealed: the frame shows none
    /// of it, it opens only under the session's key and as what it was
    /// sent as, and an endpoint in the clear (a downgrade, or an older
    /// peer) is refused on a keyed connection.
    #[test]
    fn endpoints_cross_a_keyed_connection_only_sealed() {
        let secret = b"0123456789abcdef-credential-like".to_vec();
        let ep = Endpoint {
            backend: kvlane_data::BackendKind::Tcp,
            data: secret.clone(),
        };
        let key = SessionKey::from_bytes([7; kvlane_control::SESSION_KEY_LEN]);
        let other = SessionKey::from_bytes([8; kvlane_control::SESSION_KEY_LEN]);
        let frame = DpFrame::with_endpoint(1, ep.clone(), Some(&key), Exchange::Offer).unwrap();
        let bytes = encode("an endpoint offer", &frame).unwrap();
        assert!(!bytes.windows(8).any(|w| secret.windows(8).any(|s| s == w)));
        let frame: DpFrame = decode("an endpoint offer", "p:1", &bytes).unwrap();
        assert!(frame.endpoint.is_none());
        assert_eq!(
            frame.open(Some(&key), "p:1", Exchange::Offer).unwrap(),
            Some(ep.clone())
        );
        for (session, exchange) in [
            (Some(&other), Exchange::Offer),
            (Some(&key), Exchange::Answer),
            (None, Exchange::Offer),
        ] {
            let e = frame.open(session, "p:1", exchange).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Refused, "{e}");
            assert!(e.to_string().contains("p:1"), "{e}");
        }
        let clear = DpFrame::with_endpoint(1, ep.clone(), None, Exchange::Offer).unwrap();
        assert_eq!(clear.open(None, "p:1", Exchange::Offer).unwrap(), Some(ep));
        let e = clear.open(Some(&key), "p:1", Exchange::Offer).unwrap_err();
        assert!(e.to_string().contains("in the clear"), "{e}");
    }

    #[test]
    fn a_frame_that_does_not_decode_is_refused_naming_the_peer() {
        let e = decode::<DpFrame>("an endpoint offer", "10.0.0.2:5555", b"\xc1").unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Refused);
        assert!(e.to_string().contains("10.0.0.2:5555"), "{e}");
        assert!(e.to_string().contains("an endpoint offer"), "{e}");
    }
}
