//! The per-session secret of a keyed handshake, and sealing with it.
//!
//! See [`SessionKey`].

use chacha20poly1305::aead::{Aead, KeyInit, Payload};
use chacha20poly1305::{XChaCha20Poly1305, XNonce};
use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::error::SealError;

type HmacSha256 = Hmac<Sha256>;

/// Length of a [`SessionKey`] in bytes.
pub const SESSION_KEY_LEN: usize = 32;
const NONCE: usize = 24;
const TAG: usize = 16;

/// The secret of one keyed session; only handshakes with a pre-shared key
/// have one. Its `Debug` never shows it.
///
/// A handshake with a pre-shared key ends with a secret both sides derive
/// and nobody else can: `S = H("kvlane-control/session-k", nonce_c, nonce_s,
/// identity_c, blob_c, source_c, identity_s, blob_s)` (the `H` of the
/// [`wire`](crate::wire) module docs, keyed with the pre-shared key). The nonces are fresh
/// per handshake, so every session (every connection, every reconnect) has
/// its own. An observer sees every field but not the key.
///
/// [`seal`](Self::seal) encrypts and authenticates a message under `S` for
/// one purpose (a label), so that what the peers exchange after the
/// handshake over the control connection (the data-plane endpoints with
/// their credentials) is of no use to an observer: XChaCha20-Poly1305 (the
/// RustCrypto `chacha20poly1305` crate) under `HMAC(S, "kvlane-seal/aead")`,
/// a random 24-byte nonce per message, the label as associated data:
///
/// ```text
/// sealed = nonce (24) || XChaCha20-Poly1305(key, nonce, aad = label, plaintext) (len + 16)
/// ```
#[derive(Clone, PartialEq, Eq)]
pub struct SessionKey([u8; SESSION_KEY_LEN]);

impl std::fmt::Debug for SessionKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SessionKey(..)")
    }
}

impl SessionKey {
    /// The key with these bytes. A handshake derives them (see
    /// [`SessionKey`]); this is for tests and for channels that
    /// establish a session secret of their own.
    pub fn from_bytes(bytes: [u8; SESSION_KEY_LEN]) -> Self {
        Self(bytes)
    }

    /// The AEAD keyed for sealing, apart from every other use of `S`.
    fn aead(&self) -> XChaCha20Poly1305 {
        // HMAC takes keys of any length.
        let mut m =
            <HmacSha256 as Mac>::new_from_slice(&self.0).expect("hmac takes any key length");
        m.update(b"kvlane-seal/aead");
        XChaCha20Poly1305::new(&m.finalize().into_bytes())
    }

    /// `plaintext` encrypted and authenticated for `label` (what it is
    /// for: a message sealed for one label never opens for another).
    pub fn seal(&self, label: &str, plaintext: &[u8]) -> Vec<u8> {
        let nonce: [u8; NONCE] = rand::random();
        let body = self
            .aead()
            .encrypt(
                XNonce::from_slice(&nonce),
                Payload {
                    msg: plaintext,
                    aad: label.as_bytes(),
                },
            )
            // Only a plaintext beyond the cipher's 256 GiB limit fails.
            .expect("a control message is far below XChaCha20's length limit");
        let mut out = Vec::with_capacity(NONCE + body.len());
        out.extend_from_slice(&nonce);
        out.extend_from_slice(&body);
        out
    }

    /// The plaintext of `sealed`, if it was sealed under this key for
    /// `label` and not altered since (the tag is checked before anything
    /// is returned).
    pub fn open(&self, label: &str, sealed: &[u8]) -> Result<Vec<u8>, SealError> {
        if sealed.len() < NONCE + TAG {
            return Err(SealError::TooShort {
                len: sealed.len(),
                min: NONCE + TAG,
            });
        }
        let (nonce, body) = sealed.split_at(NONCE);
        self.aead()
            .decrypt(
                XNonce::from_slice(nonce),
                Payload {
                    msg: body,
                    aad: label.as_bytes(),
                },
            )
            .map_err(|_| SealError::Mismatch {
                label: label.to_owned(),
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seal_opens_only_under_its_key_and_label_and_hides_the_plaintext() {
        let k = SessionKey::from_bytes([7; SESSION_KEY_LEN]);
        let msg = b"a credential 0123456789abcdef and more than one block of keystream";
        let sealed = k.seal("offer", msg);
        assert_eq!(sealed.len(), NONCE + msg.len() + TAG);
        assert_eq!(k.open("offer", &sealed).unwrap(), msg);
        assert!(!sealed.windows(8).any(|w| msg.windows(8).any(|m| m == w)));
        // Fresh nonce: sealing twice gives different bytes.
        assert_ne!(k.seal("offer", msg), sealed);
        assert!(matches!(
            k.open("answer", &sealed),
            Err(SealError::Mismatch { .. })
        ));
        let other = SessionKey::from_bytes([8; SESSION_KEY_LEN]);
        assert!(other.open("offer", &sealed).is_err());
        for i in 0..sealed.len() {
            let mut bad = sealed.clone();
            bad[i] ^= 1;
            assert!(k.open("offer", &bad).is_err(), "byte {i} not authenticated");
        }
        assert!(matches!(
            k.open("offer", &sealed[..NONCE + TAG - 1]),
            Err(SealError::TooShort { .. })
        ));
        assert_eq!(k.open("offer", &k.seal("offer", b"")).unwrap(), b"");
        assert_eq!(format!("{k:?}"), "SessionKey(..)");
    }
}
