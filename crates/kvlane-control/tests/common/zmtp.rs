//! Raw ZMTP bytes for tests that talk to a node below the zeromq library
//! (floods, hostile peers). Included with `#[path]` by the tests that use it.

/// A ZMTP 3.0 greeting (NULL mechanism, client) and a READY command for a
/// DEALER, as a peer sends them before its first message.
pub(crate) fn zmtp_dealer_preamble() -> Vec<u8> {
    let mut g = vec![0u8; 64];
    g[0] = 0xff;
    g[9] = 0x7f;
    g[10] = 3; // major
    g[11] = 0; // minor
    g[12..16].copy_from_slice(b"NULL");
    let mut body = vec![5u8];
    body.extend_from_slice(b"READY");
    body.push(11);
    body.extend_from_slice(b"Socket-Type");
    body.extend_from_slice(&6u32.to_be_bytes());
    body.extend_from_slice(b"DEALER");
    g.push(0x04); // short command
    g.push(body.len() as u8);
    g.extend_from_slice(&body);
    g
}
