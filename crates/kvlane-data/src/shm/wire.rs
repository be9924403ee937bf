//! Messages of the shm backend's Unix socket: one msgpack map per
//! seqpacket message, each with a `type`. Descriptors travel as
//! `SCM_RIGHTS` beside [`ToInitiator::Grant`] only.
//!
//! Compatibility: fields added after version 1 ([`Granted::attach`],
//! [`Granted::gpu`]) are optional and sent only for the regions that need
//! them, so a target serves peers of version 1 as before as long as it
//! serves only memory files. An initiator that predates a field counts
//! such a region as a memory file, finds one descriptor fewer than it
//! expects, and refuses the grant with a typed error (its connect fails)
//! rather than misreading it.

use crate::gpu::GpuRuntime;
use crate::ids::RemoteKey;
use crate::memory::Access;
use serde::{Deserialize, Serialize};

/// Version of this protocol, sent in [`ToTarget::Hello`].
pub(crate) const VERSION: u32 = 1;

/// Length of the credential a target issues per peer.
pub(crate) const TOKEN_LEN: usize = 16;

/// Largest notification payload (as the tcp backend's).
pub(crate) const MAX_NOTIFY: usize = 64 << 10;

/// Largest message either side accepts.
pub(crate) const MAX_MESSAGE: usize = MAX_NOTIFY + 1024;

/// Initiator → target.
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub(crate) enum ToTarget {
    /// First message: the credential the target issued for this peer.
    Hello {
        /// [`VERSION`].
        version: u32,
        /// The credential, [`TOKEN_LEN`] bytes.
        #[serde(with = "serde_bytes")]
        token: Vec<u8>,
    },
    /// Deliver `payload` as a notification: every byte of transfer `seq`
    /// has been copied. The target refuses it past `deadline_ns`
    /// (`CLOCK_MONOTONIC`, shared by the host's processes).
    Notify {
        /// The initiator's sequence number, echoed in the answer.
        seq: u64,
        /// Deadline of the transfer.
        deadline_ns: u64,
        /// The payload.
        #[serde(with = "serde_bytes")]
        payload: Vec<u8>,
    },
}

/// How a target answered a [`ToTarget::Notify`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum NotifyStatus {
    /// Queued for the target's application.
    Delivered,
    /// Its queue of notifications is full; not delivered.
    QueueFull,
    /// It arrived past the transfer's deadline; not delivered.
    Expired,
}

/// Target → initiator.
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub(crate) enum ToInitiator {
    /// Regions the peer may map, one descriptor each (those without an
    /// [`attach`](Granted::attach) address), in order, attached to this
    /// message. `last` ends the grants that answer a Hello.
    Grant {
        /// The regions.
        regions: Vec<Granted>,
        /// Whether this is the last grant of the answer to Hello.
        last: bool,
    },
    /// The region under `key` was deregistered: stop using it.
    Revoke {
        /// Its key.
        key: RemoteKey,
    },
    /// The answer to a notification.
    Notified {
        /// The initiator's sequence number.
        seq: u64,
        /// What became of it.
        status: NotifyStatus,
    },
}

/// One granted region.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct Granted {
    /// The key the target serves it under.
    pub(crate) key: RemoteKey,
    /// Its length.
    pub(crate) len: u64,
    /// Its remote rights.
    pub(crate) access: Access,
    /// For a region that is not a memory file, served by cross-memory
    /// attach (the target opted in): its address in the target's process.
    /// The target's pid is not sent: the initiator takes it from the
    /// kernel (`SO_PEERCRED`). Absent for a memory file (its descriptor is
    /// attached).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) attach: Option<u64>,
    /// For GPU memory: the IPC handle of the allocation that holds it.
    /// Absent for host memory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) gpu: Option<GpuGrant>,
}

/// How a peer maps a granted region of GPU memory: the driver's IPC
/// handle of the **whole** allocation that holds it (the driver maps no
/// less), and where the region lies inside it.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct GpuGrant {
    /// CUDA or ROCm.
    pub(crate) runtime: GpuRuntime,
    /// The device's PCI address (`domain:bus:device.function`, lower
    /// case): device ordinals differ between processes
    /// (`CUDA_VISIBLE_DEVICES`), PCI addresses do not.
    pub(crate) pci_bus_id: String,
    /// `CUipcMemHandle` / `hipIpcMemHandle_t`, 64 bytes, opaque.
    #[serde(with = "serde_bytes")]
    pub(crate) handle: Vec<u8>,
    /// The region's first byte, from the allocation's base.
    pub(crate) offset: u64,
}

/// Encodes a message.
pub(crate) fn encode<T: Serialize>(msg: &T) -> Vec<u8> {
    rmp_serde::to_vec_named(msg).expect("shm messages always encode")
}

/// Decodes a message; `None` for anything malformed.
pub(crate) fn decode<'a, T: Deserialize<'a>>(bytes: &'a [u8]) -> Option<T> {
    rmp_serde::from_slice(bytes).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_roundtrip_and_garbage_is_refused() {
        let m = ToTarget::Notify {
            seq: 7,
            deadline_ns: 9,
            payload: b"hi".to_vec(),
        };
        match decode::<ToTarget>(&encode(&m)) {
            Some(ToTarget::Notify {
                seq: 7, payload, ..
            }) => assert_eq!(payload, b"hi"),
            other => panic!("{other:?}"),
        }
        let g = ToInitiator::Grant {
            regions: vec![Granted {
                key: RemoteKey(3),
                len: 4096,
                access: Access::REMOTE_READ,
                attach: None,
                gpu: Some(GpuGrant {
                    runtime: GpuRuntime::Cuda,
                    pci_bus_id: "0000:c0:00.0".into(),
                    handle: vec![7; 64],
                    offset: 4096,
                }),
            }],
            last: true,
        };
        match decode::<ToInitiator>(&encode(&g)) {
            Some(ToInitiator::Grant {
                last: true,
                regions,
            }) => {
                let gpu = regions[0].gpu.as_ref().expect("gpu grant");
                assert_eq!((gpu.handle.len(), gpu.offset), (64, 4096));
            }
            other => panic!("{other:?}"),
        }
        assert!(decode::<ToTarget>(b"\xff\x00garbage").is_none());
        assert!(decode::<ToInitiator>(&[]).is_none());
    }
}
