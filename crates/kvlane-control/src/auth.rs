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

/// `HMAC(key, label || nonce_initiator || nonce_acceptor)`.
pub(crate) fn mac(key: &[u8], side: Side, nonce_i: &[u8], nonce_a: &[u8]) -> Vec<u8> {
    let mut m = match HmacSha256::new_from_slice(key) {
        Ok(m) => m,
        // HMAC accepts keys of any length; unreachable in practice.
        Err(_) => return Vec::new(),
    };
    m.update(match side {
        Side::Initiator => b"kvlane-control/initiator",
        Side::Acceptor => b"kvlane-control/acceptor!",
    });
    m.update(nonce_i);
    m.update(nonce_a);
    m.finalize().into_bytes().to_vec()
}

/// Constant-time check of a proof.
pub(crate) fn verify(key: &[u8], side: Side, nonce_i: &[u8], nonce_a: &[u8], tag: &[u8]) -> bool {
    let Ok(mut m) = HmacSha256::new_from_slice(key) else {
        return false;
    };
    m.update(match side {
        Side::Initiator => b"kvlane-control/initiator",
        Side::Acceptor => b"kvlane-control/acceptor!",
    });
    m.update(nonce_i);
    m.update(nonce_a);
    m.verify_slice(tag).is_ok()
}

/// A fresh random nonce.
pub(crate) fn nonce() -> Vec<u8> {
    let mut n = vec![0u8; NONCE_LEN];
    rand::fill(&mut n[..]);
    n
}
