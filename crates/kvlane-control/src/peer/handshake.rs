//! The handshake half of the peer machine: `hello` / `hello_ack` and, with
//! a pre-shared key, `auth` / `auth_ack`: no identity and no data-plane blob
//! leaves before the other side proved the key, and the proofs cover the
//! transcript (see the `wire` module docs).

use std::time::Instant;

use super::{encode, Hs, Peer, Transmit};
use crate::auth::{self, Proof};
use crate::config::RemoteInfo;
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
        if fingerprint != self.local.identity.fingerprint {
            return Some(Refusal::Fingerprint {
                local: self.local.identity.fingerprint.clone(),
                remote: fingerprint.to_owned(),
            });
        }
        None
    }

    pub(super) fn on_hello(&mut self, now: Instant, h: Hello) {
        self.timers
            .set(Timer::Handshake, now + self.config.handshake_timeout);
        match (self.key(), h.auth) {
            (None, false) => {
                if let Some(r) = self.check_compat(h.version, &h.identity.fingerprint) {
                    return self.refuse(now, r, true);
                }
                let peer_host = h.source.as_deref().and_then(|s| s.parse().ok());
                let identity = h.identity;
                let data_plane = h.data_plane.map(|b| b.into_vec()).unwrap_or_default();
                let ack =
                    HelloAck::plain(self.local.identity.clone(), self.local.data_plane.clone());
                self.transmits
                    .push_back(Transmit::Frame(encode(&Message::HelloAck(ack))));
                self.become_ready(
                    now,
                    RemoteInfo {
                        identity,
                        data_plane,
                        peer_host,
                    },
                );
            }
            (Some(key), true) => {
                // Before the key is proven the peer learns our version and a
                // nonce, nothing else: compatibility is checked after `auth`.
                if h.version != PROTOCOL_VERSION {
                    return self.refuse(
                        now,
                        Refusal::Version {
                            local: PROTOCOL_VERSION,
                            remote: h.version,
                        },
                        true,
                    );
                }
                if h.nonce.len() != auth::NONCE_LEN {
                    let reason = format!(
                        "{} sent a {}-byte nonce, not {}",
                        self.addr,
                        h.nonce.len(),
                        auth::NONCE_LEN
                    );
                    return self.refuse(now, Refusal::Auth { reason }, true);
                }
                let nonce_a = auth::nonce();
                let mac = auth::mac(&key, Proof::AcceptorHello, &[&h.nonce, &nonce_a]);
                let ack = HelloAck::keyed(nonce_a.clone(), mac);
                self.transmits
                    .push_back(Transmit::Frame(encode(&Message::HelloAck(ack))));
                self.hs = Some(Hs::HelloAck {
                    nonce_i: h.nonce,
                    nonce_a,
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
        match self.key() {
            None => {
                if let Some(r) = self.check_compat(ack.version, &ack.identity.fingerprint) {
                    return self.refuse(now, r, true);
                }
                let identity = ack.identity;
                let Some(blob) = ack.data_plane else {
                    let reason =
                        format!("{} requires a key but none is configured here", self.addr);
                    return self.refuse(now, Refusal::Auth { reason }, true);
                };
                self.become_ready(
                    now,
                    RemoteInfo {
                        identity,
                        data_plane: blob.into_vec(),
                        peer_host: self.route.peer,
                    },
                );
            }
            Some(key) => {
                if ack.version != PROTOCOL_VERSION {
                    let r = Refusal::Version {
                        local: PROTOCOL_VERSION,
                        remote: ack.version,
                    };
                    return self.refuse(now, r, true);
                }
                if ack.nonce.len() != auth::NONCE_LEN
                    || !auth::verify(
                        &key,
                        Proof::AcceptorHello,
                        &[&nonce_i, &ack.nonce],
                        &ack.mac,
                    )
                {
                    let reason = format!("{} failed to prove the pre-shared key", self.addr);
                    return self.refuse(now, Refusal::Auth { reason }, true);
                }
                let identity = self.local.identity.transcript_bytes();
                let blob = &self.local.data_plane;
                let mac = auth::mac(
                    &key,
                    Proof::Initiator,
                    &[&nonce_i, &ack.nonce, &identity, blob],
                );
                let msg = Message::Auth(Auth {
                    version: PROTOCOL_VERSION,
                    mac,
                    data_plane: blob.clone(),
                    identity: self.local.identity.clone(),
                    source: self.route.source.map(|ip| ip.to_string()),
                });
                self.transmits.push_back(Transmit::Frame(encode(&msg)));
                self.hs = Some(Hs::Auth {
                    nonce_i,
                    nonce_a: ack.nonce,
                });
            }
        }
    }

    pub(super) fn on_auth(&mut self, now: Instant, a: Auth) {
        let Some(Hs::HelloAck { nonce_i, nonce_a }) = self.hs.take() else {
            self.stats.unexpected += 1;
            return;
        };
        let Some(key) = self.key() else {
            self.stats.unexpected += 1;
            return;
        };
        let ident_i = a.identity.transcript_bytes();
        if !auth::verify(
            &key,
            Proof::Initiator,
            &[&nonce_i, &nonce_a, &ident_i, &a.data_plane],
            &a.mac,
        ) {
            let reason = format!("{} failed to prove the pre-shared key", self.addr);
            return self.refuse(now, Refusal::Auth { reason }, true);
        }
        // The peer is authenticated: from here on a refusal may name values.
        if let Some(r) = self.check_compat(a.version, &a.identity.fingerprint) {
            return self.refuse(now, r, true);
        }
        let local = self.local.identity.clone();
        let ident_a = local.transcript_bytes();
        let blob_a = &self.local.data_plane;
        let mac = auth::mac(
            &key,
            Proof::AcceptorFinal,
            &[
                &nonce_i,
                &nonce_a,
                &ident_i,
                &a.data_plane,
                &ident_a,
                blob_a,
            ],
        );
        let ack = AuthAck {
            version: PROTOCOL_VERSION,
            mac,
            data_plane: blob_a.clone(),
            identity: local,
        };
        self.transmits
            .push_back(Transmit::Frame(encode(&Message::AuthAck(ack))));
        let peer_host = a.source.as_deref().and_then(|s| s.parse().ok());
        self.become_ready(
            now,
            RemoteInfo {
                identity: a.identity,
                data_plane: a.data_plane,
                peer_host,
            },
        );
    }

    pub(super) fn on_auth_ack(&mut self, now: Instant, a: AuthAck) {
        let Some(Hs::Auth { nonce_i, nonce_a }) = self.hs.take() else {
            self.stats.unexpected += 1;
            return;
        };
        let Some(key) = self.key() else {
            self.stats.unexpected += 1;
            return;
        };
        let ident_i = self.local.identity.transcript_bytes();
        let ident_a = a.identity.transcript_bytes();
        if !auth::verify(
            &key,
            Proof::AcceptorFinal,
            &[
                &nonce_i,
                &nonce_a,
                &ident_i,
                &self.local.data_plane,
                &ident_a,
                &a.data_plane,
            ],
            &a.mac,
        ) {
            let reason = format!("{} sent an auth_ack that does not prove the key", self.addr);
            return self.refuse(now, Refusal::Auth { reason }, true);
        }
        if let Some(r) = self.check_compat(a.version, &a.identity.fingerprint) {
            return self.refuse(now, r, true);
        }
        self.become_ready(
            now,
            RemoteInfo {
                identity: a.identity,
                data_plane: a.data_plane,
                peer_host: self.route.peer,
            },
        );
    }

    /// The pre-shared key, if one is configured.
    fn key(&self) -> Option<Vec<u8>> {
        self.config.psk.as_ref().map(|k| k.as_bytes().to_vec())
    }
}
