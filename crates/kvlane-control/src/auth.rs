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
    /// The tag in the second half of a nonce: who made it (see [`own_nonce`]).
    NonceTag,
    /// Not a proof: the session secret both sides derive from the whole
    /// transcript (see [`session_key`]).
    Session,
}

impl Proof {
    fn label(self) -> &'static [u8] {
        match self {
            Self::AcceptorHello => b"kvlane-control/acceptor!",
            Self::Initiator => b"kvlane-control/initiator",
            Self::AcceptorFinal => b"kvlane-control/acceptor2",
            Self::NonceTag => b"kvlane-control/nonce-tag",
            Self::Session => b"kvlane-control/session-k",
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

/// The session secret of a keyed handshake over `transcript` (the fields
/// of the acceptor's final proof); `None` for an empty key.
pub(crate) fn session_key(key: &[u8], transcript: &[&[u8]]) -> Option<crate::SessionKey> {
    let m = keyed(key, Proof::Session, transcript)?;
    Some(crate::SessionKey::from_bytes(
        m.finalize().into_bytes().into(),
    ))
}

/// A fresh random nonce.
pub(crate) fn nonce() -> Vec<u8> {
    let mut n = vec![0u8; NONCE_LEN];
    rand::fill(&mut n[..]);
    n
}

/// Random bytes in a nonce; the rest is the maker's tag.
const NONCE_RANDOM: usize = NONCE_LEN / 2;

/// A fresh nonce its maker can recognize: 16 random bytes `r`, then the
/// first 16 bytes of `H("kvlane-control/nonce-tag", r, identity)`, where
/// `identity` is the maker's [`transcript_bytes`](crate::wire::Identity::transcript_bytes).
/// Without the key it looks random and names nobody; a key holder tells
/// its own nonces apart ([`is_own_nonce`]), so a proof over a nonce it made
/// itself is never taken for a peer's (a reflected handshake). Random for
/// an empty key, which proves nothing anyway.
pub(crate) fn own_nonce(key: &[u8], identity: &[u8]) -> Vec<u8> {
    let mut n = nonce();
    if let Some(m) = keyed(key, Proof::NonceTag, &[&n[..NONCE_RANDOM], identity]) {
        n[NONCE_RANDOM..].copy_from_slice(&m.finalize().into_bytes()[..NONCE_LEN - NONCE_RANDOM]);
    }
    n
}

/// Whether `nonce` was made by [`own_nonce`] for `identity` (constant time).
pub(crate) fn is_own_nonce(key: &[u8], identity: &[u8], nonce: &[u8]) -> bool {
    nonce.len() == NONCE_LEN
        && keyed(key, Proof::NonceTag, &[&nonce[..NONCE_RANDOM], identity])
            .is_some_and(|m| m.verify_truncated_left(&nonce[NONCE_RANDOM..]).is_ok())
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
    fn a_node_recognizes_its_own_nonces_and_nobody_elses() {
        let (k, me, other) = (b"key", b"me".as_slice(), b"other".as_slice());
        let n = own_nonce(k, me);
        assert_eq!(n.len(), NONCE_LEN);
        assert!(is_own_nonce(k, me, &n));
        assert!(!is_own_nonce(k, other, &n));
        assert!(!is_own_nonce(b"other key", me, &n));
        assert!(!is_own_nonce(k, me, &nonce()));
        assert!(!is_own_nonce(k, me, &n[..NONCE_LEN - 1]));
        assert!(!is_own_nonce(b"", me, &own_nonce(b"", me)));
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
