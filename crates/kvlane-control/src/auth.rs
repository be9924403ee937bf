//! HMAC-SHA256 proofs of the pre-shared key over both handshake nonces.

use hmac::{Hmac, Mac};
use sha2::Sha256;

type HmacSha256 = Hmac<Sha256>;

/// Length of handshake nonces in bytes.
pub(crate) const NONCE_LEN: usize = 32;

/// Which side computes the proof; the labels keep the two proofs distinct so
/// one cannot be reflected as the other.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Side {
    Initiator,
    Acceptor,
}

fn keyed(key: &[u8], side: Side, nonce_i: &[u8], nonce_a: &[u8]) -> Option<HmacSha256> {
    // HMAC accepts keys of any length, so this never fails in practice.
    let mut m = HmacSha256::new_from_slice(key).ok()?;
    m.update(match side {
        Side::Initiator => b"kvlane-control/initiator",
        Side::Acceptor => b"kvlane-control/acceptor!",
    });
    m.update(nonce_i);
    m.update(nonce_a);
    Some(m)
}

/// `HMAC(key, label || nonce_initiator || nonce_acceptor)`.
pub(crate) fn mac(key: &[u8], side: Side, nonce_i: &[u8], nonce_a: &[u8]) -> Vec<u8> {
    keyed(key, side, nonce_i, nonce_a)
        .map(|m| m.finalize().into_bytes().to_vec())
        .unwrap_or_default()
}

/// Constant-time check of a proof.
pub(crate) fn verify(key: &[u8], side: Side, nonce_i: &[u8], nonce_a: &[u8], tag: &[u8]) -> bool {
    keyed(key, side, nonce_i, nonce_a).is_some_and(|m| m.verify_slice(tag).is_ok())
}

/// A fresh random nonce.
pub(crate) fn nonce() -> Vec<u8> {
    let mut n = vec![0u8; NONCE_LEN];
    rand::fill(&mut n[..]);
    n
}
