//! The handshake half of the peer machine: `hello` / `hello_ack` and, with
//! a pre-shared key, `auth` / `auth_ack`: no identity and no data-plane blob
//! leaves before the other side proved the key, and the proofs cover the
//! transcript (see the `wire` module docs).

use std::time::Instant;

use tracing::debug;

use super::{encode, Hs, Peer, Transmit};
use crate::auth::{self, Proof};
use crate::config::{check_engine_id, RemoteInfo};
use crate::error::Refusal;
use crate::timer::Timer;
use crate::wire::{Auth, AuthAck, Hello, HelloAck, Identity, Message, PROTOCOL_VERSION};

/// The bytes of an `auth`'s `source` in the transcript the MACs cover
/// (absent: empty; no address is empty).
fn source_bytes(source: Option<&str>) -> &[u8] {
    source.unwrap_or("").as_bytes()
}

impl Peer {
    /// What the peer's identity (as its handshake states it) makes us
    /// refuse: another protocol version, another config fingerprint, or an
    /// engine id that cannot name an engine (a peer known by no name, or by
    /// one that breaks log lines, cannot be told apart from another).
    pub(super) fn check_compat(&self, version: u16, identity: &Identity) -> Option<Refusal> {
        if version != PROTOCOL_VERSION {
            return Some(Refusal::Version {
                local: PROTOCOL_VERSION,
                remote: version,
            });
        }
        if identity.fingerprint != self.local.identity.fingerprint {
            return Some(Refusal::Fingerprint {
                local: self.local.identity.fingerprint.clone(),
                remote: identity.fingerprint.clone(),
            });
        }
        if let Err(problem) = check_engine_id(&identity.engine_id) {
            return Some(Refusal::EngineId {
                peer: self.addr.clone(),
                problem,
            });
        }
        None
    }

    pub(super) fn on_hello(&mut self, now: Instant, h: Hello) {
        self.settle_local();
        self.timers
            .set(Timer::Handshake, now + self.config.handshake_timeout);
        match (self.key(), h.auth) {
            (None, false) => {
                if let Some(r) = self.check_compat(h.version, &h.identity) {
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
                        session: None,
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
                let me = self.local.identity.transcript_bytes();
                if auth::is_own_nonce(&key, &me, &h.nonce) {
                    // Our own dialing side's hello, relayed back to us: a
                    // proof over it would be accepted by that side.
                    return self.refuse_reflected(now);
                }
                let nonce_a = auth::own_nonce(&key, &me);
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
        let nonce_i = match self.hs.take() {
            Some(Hs::Hello { nonce_i }) => nonce_i,
            other => return self.wrong_step(other, "hello_ack"),
        };
        match self.key() {
            None => {
                if let Some(r) = self.check_compat(ack.version, &ack.identity) {
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
                        session: None,
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
                if auth::is_own_nonce(&key, &identity, &ack.nonce) {
                    // The proof was made by our own acceptor (our hello was
                    // relayed to it): nobody else proved the key.
                    return self.refuse_reflected(now);
                }
                let blob = &self.local.data_plane;
                let source = self.route.source.map(|ip| ip.to_string());
                let mac = auth::mac(
                    &key,
                    Proof::Initiator,
                    &[
                        &nonce_i,
                        &ack.nonce,
                        &identity,
                        blob,
                        source_bytes(source.as_deref()),
                    ],
                );
                let msg = Message::Auth(Auth {
                    version: PROTOCOL_VERSION,
                    mac,
                    data_plane: blob.clone(),
                    identity: self.local.identity.clone(),
                    source,
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
        let (nonce_i, nonce_a) = match self.hs.take() {
            Some(Hs::HelloAck { nonce_i, nonce_a }) => (nonce_i, nonce_a),
            other => return self.wrong_step(other, "auth"),
        };
        let Some(key) = self.key() else {
            self.stats.unexpected += 1;
            return;
        };
        let ident_i = a.identity.transcript_bytes();
        let source_i = source_bytes(a.source.as_deref());
        if !auth::verify(
            &key,
            Proof::Initiator,
            &[&nonce_i, &nonce_a, &ident_i, &a.data_plane, source_i],
            &a.mac,
        ) {
            let reason = format!("{} failed to prove the pre-shared key", self.addr);
            return self.refuse(now, Refusal::Auth { reason }, true);
        }
        if a.identity == self.local.identity {
            return self.refuse_reflected(now);
        }
        // The peer is authenticated: from here on a refusal may name values.
        if let Some(r) = self.check_compat(a.version, &a.identity) {
            return self.refuse(now, r, true);
        }
        let local = self.local.identity.clone();
        let ident_a = local.transcript_bytes();
        let blob_a = &self.local.data_plane;
        let transcript: [&[u8]; 7] = [
            &nonce_i,
            &nonce_a,
            &ident_i,
            &a.data_plane,
            source_i,
            &ident_a,
            blob_a,
        ];
        let mac = auth::mac(&key, Proof::AcceptorFinal, &transcript);
        let session = auth::session_key(&key, &transcript);
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
                session,
            },
        );
    }

    pub(super) fn on_auth_ack(&mut self, now: Instant, a: AuthAck) {
        let (nonce_i, nonce_a) = match self.hs.take() {
            Some(Hs::Auth { nonce_i, nonce_a }) => (nonce_i, nonce_a),
            other => return self.wrong_step(other, "auth_ack"),
        };
        let Some(key) = self.key() else {
            self.stats.unexpected += 1;
            return;
        };
        let ident_i = self.local.identity.transcript_bytes();
        let ident_a = a.identity.transcript_bytes();
        let source = self.route.source.map(|ip| ip.to_string());
        let transcript: [&[u8]; 7] = [
            &nonce_i,
            &nonce_a,
            &ident_i,
            &self.local.data_plane,
            source_bytes(source.as_deref()),
            &ident_a,
            &a.data_plane,
        ];
        if !auth::verify(&key, Proof::AcceptorFinal, &transcript, &a.mac) {
            let reason = format!("{} sent an auth_ack that does not prove the key", self.addr);
            return self.refuse(now, Refusal::Auth { reason }, true);
        }
        if a.identity == self.local.identity {
            return self.refuse_reflected(now);
        }
        if let Some(r) = self.check_compat(a.version, &a.identity) {
            return self.refuse(now, r, true);
        }
        let session = auth::session_key(&key, &transcript);
        self.become_ready(
            now,
            RemoteInfo {
                identity: a.identity,
                data_plane: a.data_plane,
                peer_host: self.route.peer,
                session,
            },
        );
    }

    /// A handshake frame for another step (or none in flight): dropped and
    /// counted, and the handshake state it found is put back, so the right
    /// frame still completes it and its deadline still fires.
    fn wrong_step(&mut self, hs: Option<Hs>, frame: &str) {
        debug!(peer = %self.addr, frame, awaiting = ?hs.as_ref().map(Hs::awaits), "handshake frame for another step dropped");
        self.hs = hs;
        self.stats.unexpected += 1;
    }

    /// The handshake came back to us (see [`Refusal::Reflected`]).
    fn refuse_reflected(&mut self, now: Instant) {
        let peer = self.addr.clone();
        self.refuse(now, Refusal::Reflected { peer }, true);
    }

    /// The pre-shared key, if one is configured.
    fn key(&self) -> Option<Vec<u8>> {
        self.config.psk.as_ref().map(|k| k.as_bytes().to_vec())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Instant;

    use super::*;
    use crate::config::{Config, LocalInfo, Psk};
    use crate::ids::Ranks;
    use crate::peer::Event;

    /// The dialer's own check, apart from the acceptor's: a valid proof
    /// over a nonce made by this very identity is a proof by this node
    /// (its hello was relayed to its own acceptor, or to an acceptor that
    /// does not check): refused, and no `auth` leaves.
    #[test]
    fn dialer_refuses_a_proof_its_own_identity_made() {
        let key = b"k";
        let config = Arc::new(Config {
            psk: Some(Psk::new(&key[..])),
            ..Config::default()
        });
        let ranks = Ranks {
            dp_rank: 0,
            tp_rank: 0,
            tp_size: 1,
        };
        let local = Arc::new(LocalInfo::new("a", ranks, "fp").with_data_plane(b"blob".to_vec()));
        let now = Instant::now();
        let mut p = Peer::initiator(now, "x:1".into(), config, Arc::clone(&local));
        let nonce_c = std::iter::from_fn(|| p.poll_transmit())
            .find_map(|t| match t {
                Transmit::Frame(f) => match Message::decode(&f, 1 << 20) {
                    Ok(Message::Hello(h)) => Some(h.nonce),
                    _ => None,
                },
                _ => None,
            })
            .expect("hello");
        let nonce_a = auth::own_nonce(key, &local.identity.transcript_bytes());
        let mac = auth::mac(key, Proof::AcceptorHello, &[&nonce_c, &nonce_a]);
        p.handle_message(now, Message::HelloAck(HelloAck::keyed(nonce_a, mac)));
        for t in std::iter::from_fn(|| p.poll_transmit()) {
            if let Transmit::Frame(f) = t {
                assert!(!matches!(
                    Message::decode(&f, 1 << 20),
                    Ok(Message::Auth(_))
                ));
            }
        }
        let events: Vec<_> = std::iter::from_fn(|| p.poll_event()).collect();
        assert!(
            events.iter().any(|e| matches!(
                e,
                Event::Refused {
                    refusal: Refusal::Reflected { .. },
                    ..
                }
            )),
            "{events:?}"
        );
    }
}
