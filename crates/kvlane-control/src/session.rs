//! The per-session secret of a keyed handshake, and sealing with it.
//!
//! See [`SessionKey`].

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::error::SealError;

type HmacSha256 = Hmac<Sha256>;

/// Length of a [`SessionKey`] in bytes.
pub const SESSION_KEY_LEN: usize = 32;
const NONCE: usize = 16;
const TAG: usize = 32;

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
/// their credentials) is of no use to an observer: an HMAC-SHA256 keystream
/// (counter mode) over a random 16-byte nonce, then an HMAC-SHA256 tag over
/// label, nonce and ciphertext (encrypt-then-MAC, with keys derived apart):
///
/// ```text
/// k_enc = HMAC(S, "kvlane-seal/enc"), k_mac = HMAC(S, "kvlane-seal/mac")
/// block_i = HMAC(k_enc, len(label) || label || nonce || i_u64_be)
/// sealed = nonce (16) || plaintext XOR block_0 || block_1 ... || HMAC(k_mac, len(label) || label || nonce || ciphertext) (32)
/// ```
#[derive(Clone, PartialEq, Eq)]
pub struct SessionKey([u8; SESSION_KEY_LEN]);

impl std::fmt::Debug for SessionKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SessionKey(..)")
    }
}

fn hmac(key: &[u8]) -> HmacSha256 {
    // HMAC takes keys of any length.
    <HmacSha256 as Mac>::new_from_slice(key).expect("hmac takes any key length")
}

impl SessionKey {
    /// The key with these bytes. A handshake derives them (see
    /// [`SessionKey`]); this is for tests and for channels that
    /// establish a session secret of their own.
    pub fn from_bytes(bytes: [u8; SESSION_KEY_LEN]) -> Self {
        Self(bytes)
    }

    fn derive(&self, label: &[u8]) -> HmacSha256 {
        let mut m = hmac(&self.0);
        m.update(label);
        hmac(&m.finalize().into_bytes())
    }

    fn labelled(mut m: HmacSha256, label: &str, nonce: &[u8]) -> HmacSha256 {
        m.update(&(label.len() as u64).to_be_bytes());
        m.update(label.as_bytes());
        m.update(nonce);
        m
    }

    /// XORs `data` with the keystream of `label` and `nonce`.
    fn apply(&self, label: &str, nonce: &[u8], data: &mut [u8]) {
        let enc = Self::labelled(self.derive(b"kvlane-seal/enc"), label, nonce);
        for (i, chunk) in data.chunks_mut(32).enumerate() {
            let mut m = enc.clone();
            m.update(&(i as u64).to_be_bytes());
            let block = m.finalize().into_bytes();
            for (b, k) in chunk.iter_mut().zip(block.iter()) {
                *b ^= k;
            }
        }
    }

    fn tag(&self, label: &str, nonce: &[u8], ciphertext: &[u8]) -> HmacSha256 {
        let mut m = Self::labelled(self.derive(b"kvlane-seal/mac"), label, nonce);
        m.update(ciphertext);
        m
    }

    /// `plaintext` encrypted and authenticated for `label` (what it is
    /// for: a message sealed for one label never opens for another).
    pub fn seal(&self, label: &str, plaintext: &[u8]) -> Vec<u8> {
        let nonce: [u8; NONCE] = rand::random();
        let mut out = Vec::with_capacity(NONCE + plaintext.len() + TAG);
        out.extend_from_slice(&nonce);
        out.extend_from_slice(plaintext);
        self.apply(label, &nonce, &mut out[NONCE..]);
        let tag = self
            .tag(label, &nonce, &out[NONCE..])
            .finalize()
            .into_bytes();
        out.extend_from_slice(&tag);
        out
    }

    /// The plaintext of `sealed`, if it was sealed under this key for
    /// `label` and not altered since (the tag is checked, in constant
    /// time, before anything is decrypted).
    pub fn open(&self, label: &str, sealed: &[u8]) -> Result<Vec<u8>, SealError> {
        if sealed.len() < NONCE + TAG {
            return Err(SealError::TooShort {
                len: sealed.len(),
                min: NONCE + TAG,
            });
        }
        let (nonce, rest) = sealed.split_at(NONCE);
        let (ciphertext, tag) = rest.split_at(rest.len() - TAG);
        self.tag(label, nonce, ciphertext)
            .verify_slice(tag)
            .map_err(|_| SealError::Mismatch {
                label: label.to_owned(),
            })?;
        let mut plain = ciphertext.to_vec();
        self.apply(label, nonce, &mut plain);
        Ok(plain)
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
