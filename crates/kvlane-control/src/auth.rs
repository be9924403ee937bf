//! HMAC-SHA256 proofs of the pre-shared key over the handshake transcript
//! (see the `wire` module docs for what each proof covers).

use hmac::{Hmac, Mac};
use sha2::Sha256;

type HmacSha256 = Hmac<Sha256>;

/// Length of handshake nonces in bytes; a nonce of any other length is refused.
pub(crate) const NONCE_LEN: usize = 32;

/// Which proof is computed; the labels keep the proofs distinct so one
/// cannot be reflected as another.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Proof {
    /// The acceptor's first proof (`hello_ack`): both nonces.
    AcceptorHello,
    /// The initiator's proof (`auth`): nonces, its identity and blob.
    Initiator,
    /// The acceptor's final proof (`auth_ack`): the whole transcript.
    AcceptorFinal,
}

impl Proof {
    fn label(self) -> &'static [u8] {
        match self {
            Self::AcceptorHello => b"kvlane-control/acceptor!",
            Self::Initiator => b"kvlane-control/initiator",
            Self::AcceptorFinal => b"kvlane-control/acceptor2",
        }
    }
}

/// HMAC over `label || (len_u64_be || field)…`; `None` for an empty key,
/// which proves nothing.
fn keyed(key: &[u8], proof: Proof, fields: &[&[u8]]) -> Option<HmacSha256> {
    if key.is_empty() {
        return None;
    }
    let mut m = HmacSha256::new_from_slice(key).ok()?;
    m.update(proof.label());
    for f in fields {
        m.update(&(f.len() as u64).to_be_bytes());
        m.update(f);
    }
    Some(m)
}

/// The proof of `proof` over `fields` (empty for an empty key, which then
/// never verifies).
pub(crate) fn mac(key: &[u8], proof: Proof, fields: &[&[u8]]) -> Vec<u8> {
    keyed(key, proof, fields)
        .map(|m| m.finalize().into_bytes().to_vec())
        .unwrap_or_default()
}

/// Constant-time check of a proof; an empty key never verifies.
pub(crate) fn verify(key: &[u8], proof: Proof, fields: &[&[u8]], tag: &[u8]) -> bool {
    keyed(key, proof, fields).is_some_and(|m| m.verify_slice(tag).is_ok())
}

/// A fresh random nonce.
pub(crate) fn nonce() -> Vec<u8> {
    let mut n = vec![0u8; NONCE_LEN];
    rand::fill(&mut n[..]);
    n
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_key_never_verifies() {
        let tag = mac(b"", Proof::Initiator, &[b"a"]);
        assert!(tag.is_empty());
        assert!(!verify(b"", Proof::Initiator, &[b"a"], &tag));
    }

    #[test]
    fn fields_are_length_prefixed_and_labels_distinct() {
        let k = b"key";
        let t = mac(k, Proof::Initiator, &[b"ab", b"c"]);
        assert!(verify(k, Proof::Initiator, &[b"ab", b"c"], &t));
        assert!(!verify(k, Proof::Initiator, &[b"a", b"bc"], &t));
        assert!(!verify(k, Proof::AcceptorFinal, &[b"ab", b"c"], &t));
    }
}
