//! The handshake half of the peer machine: `hello` / `hello_ack` and, with
//! a pre-shared key, `auth` / `auth_ack` (no data-plane blob leaves before
//! the other side proved the key).

use std::sync::Arc;
use std::time::Instant;

use super::{encode, Hs, Peer, Transmit};
use crate::auth::{self, Side};
use crate::config::{Ranks, RemoteInfo};
use crate::error::Refusal;
use crate::timer::Timer;
use crate::wire::{Auth, AuthAck, Hello, HelloAck, Message, PROTOCOL_VERSION};

impl Peer {
    pub(super) fn check_compat(&self, version: u16, fingerprint: &str) -> Option<Refusal> {
        if version != PROTOCOL_VERSION {
            return Some(Refusal::Version {
                local: PROTOCOL_VERSION,
                remote: version,
            });
        }
        if fingerprint != self.local.fingerprint {
            return Some(Refusal::Fingerprint {
                local: self.local.fingerprint.clone(),
                remote: fingerprint.to_owned(),
            });
        }
        None
    }

    pub(super) fn on_hello(&mut self, now: Instant, h: Hello) {
        self.timers
            .set(Timer::Handshake, now + self.config.handshake_timeout);
        if let Some(r) = self.check_compat(h.version, &h.fingerprint) {
            return self.refuse(now, r, true);
        }
        let mut remote = RemoteInfo {
            engine_id: h.engine_id,
            incarnation: h.incarnation,
            ranks: Ranks {
                dp_rank: h.dp_rank,
                tp_rank: h.tp_rank,
                tp_size: h.tp_size,
            },
            fingerprint: h.fingerprint,
            data_plane: Vec::new(),
            capabilities: h.capabilities,
            peer_host: h.source.as_deref().and_then(|s| s.parse().ok()),
        };
        let l = Arc::clone(&self.local);
        let mut ack = HelloAck {
            version: PROTOCOL_VERSION,
            engine_id: l.engine_id.clone(),
            incarnation: l.incarnation,
            dp_rank: l.ranks.dp_rank,
            tp_rank: l.ranks.tp_rank,
            tp_size: l.ranks.tp_size,
            fingerprint: l.fingerprint.clone(),
            capabilities: l.capabilities.clone(),
            nonce: Vec::new(),
            mac: Vec::new(),
            data_plane: None,
        };
        match (
            self.config.psk.as_ref().map(|k| k.as_bytes().to_vec()),
            h.auth,
        ) {
            (None, false) => {
                remote.data_plane = h.data_plane.map(|b| b.into_vec()).unwrap_or_default();
                ack.data_plane = Some(serde_bytes::ByteBuf::from(l.data_plane.clone()));
                self.transmits
                    .push_back(Transmit::Frame(encode(&Message::HelloAck(ack))));
                self.become_ready(now, remote);
            }
            (Some(key), true) => {
                let nonce_a = auth::nonce();
                ack.mac = auth::mac(&key, Side::Acceptor, &h.nonce, &nonce_a);
                ack.nonce = nonce_a.clone();
                self.transmits
                    .push_back(Transmit::Frame(encode(&Message::HelloAck(ack))));
                self.hs = Some(Hs::HelloAck {
                    nonce_i: h.nonce,
                    nonce_a,
                    remote,
                });
            }
            (Some(_), false) => self.refuse(
                now,
                Refusal::Auth {
                    reason: format!("{} sent no key proof but a key is required", self.addr),
                },
                true,
            ),
            (None, true) => self.refuse(
                now,
                Refusal::Auth {
                    reason: format!("{} requires a key but none is configured here", self.addr),
                },
                true,
            ),
        }
    }

    pub(super) fn on_hello_ack(&mut self, now: Instant, ack: HelloAck) {
        let Some(Hs::Hello { nonce_i }) = self.hs.take() else {
            self.stats.unexpected += 1;
            return;
        };
        if let Some(r) = self.check_compat(ack.version, &ack.fingerprint) {
            return self.refuse(now, r, true);
        }
        let mut remote = RemoteInfo {
            engine_id: ack.engine_id,
            incarnation: ack.incarnation,
            ranks: Ranks {
                dp_rank: ack.dp_rank,
                tp_rank: ack.tp_rank,
                tp_size: ack.tp_size,
            },
            fingerprint: ack.fingerprint,
            data_plane: Vec::new(),
            capabilities: ack.capabilities,
            peer_host: self.route.peer,
        };
        match self.config.psk.as_ref().map(|k| k.as_bytes().to_vec()) {
            None => {
                let Some(blob) = ack.data_plane else {
                    let reason =
                        format!("{} requires a key but none is configured here", self.addr);
                    return self.refuse(now, Refusal::Auth { reason }, true);
                };
                remote.data_plane = blob.into_vec();
                self.become_ready(now, remote);
            }
            Some(key) => {
                if !auth::verify(&key, Side::Acceptor, &nonce_i, &ack.nonce, &ack.mac) {
                    let reason = format!("{} failed to prove the pre-shared key", self.addr);
                    return self.refuse(now, Refusal::Auth { reason }, true);
                }
                let msg = Message::Auth(Auth {
                    version: PROTOCOL_VERSION,
                    mac: auth::mac(&key, Side::Initiator, &nonce_i, &ack.nonce),
                    data_plane: self.local.data_plane.clone(),
                });
                self.transmits.push_back(Transmit::Frame(encode(&msg)));
                self.hs = Some(Hs::Auth { remote });
            }
        }
    }

    pub(super) fn on_auth(&mut self, now: Instant, a: Auth) {
        let Some(Hs::HelloAck {
            nonce_i,
            nonce_a,
            mut remote,
        }) = self.hs.take()
        else {
            self.stats.unexpected += 1;
            return;
        };
        let Some(key) = self.config.psk.as_ref().map(|k| k.as_bytes().to_vec()) else {
            self.stats.unexpected += 1;
            return;
        };
        if !auth::verify(&key, Side::Initiator, &nonce_i, &nonce_a, &a.mac) {
            let reason = format!("{} failed to prove the pre-shared key", self.addr);
            return self.refuse(now, Refusal::Auth { reason }, true);
        }
        remote.data_plane = a.data_plane;
        let ack = AuthAck {
            version: PROTOCOL_VERSION,
            data_plane: self.local.data_plane.clone(),
        };
        self.transmits
            .push_back(Transmit::Frame(encode(&Message::AuthAck(ack))));
        self.become_ready(now, remote);
    }

    pub(super) fn on_auth_ack(&mut self, now: Instant, a: AuthAck) {
        let Some(Hs::Auth { mut remote }) = self.hs.take() else {
            self.stats.unexpected += 1;
            return;
        };
        remote.data_plane = a.data_plane;
        self.become_ready(now, remote);
    }
}
