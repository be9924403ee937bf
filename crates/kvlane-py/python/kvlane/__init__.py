"""kvlane: a KV-cache transport for LLM inference engines.

The native API mirrors the Rust facade::

    import numpy as np, kvlane

    layout = kvlane.KvLayout(layers=2, blocks=16, block_bytes=4096)
    kv = np.zeros(layout.required_len, dtype=np.uint8)
    with kvlane.Agent(engine_id="prefill", backend="tcp", kv=[(layout, kv)]) as agent:
        peer = agent.connect("127.0.0.1:5555")
        peer.write_blocks((0, 2), [0, 1], [8, 9], notify=b"req-1").wait()

``kvlane.nixl`` offers NIXL's ``nixl_agent`` on top of it.
"""

from kvlane._kvlane import (
    Agent,
    BusyError,
    ClosedError,
    Error,
    InvalidInputError,
    IoError,
    KvLayout,
    Memory,
    Notification,
    Notifications,
    Peer,
    PeerEvent,
    PeerEvents,
    PeerLostError,
    PreparedTransfer,
    RefusedError,
    StaleError,
    Telemetry,
    TimeoutError,
    Transfer,
    UnsupportedError,
    __version__,
)

__all__ = [
    "Agent",
    "BusyError",
    "ClosedError",
    "Error",
    "InvalidInputError",
    "IoError",
    "KvLayout",
    "Memory",
    "Notification",
    "Notifications",
    "Peer",
    "PeerEvent",
    "PeerEvents",
    "PeerLostError",
    "PreparedTransfer",
    "RefusedError",
    "StaleError",
    "Telemetry",
    "TimeoutError",
    "Transfer",
    "UnsupportedError",
    "__version__",
]
