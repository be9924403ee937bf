"""kvlane: a KV-cache transport for LLM inference engines.

The native API mirrors the Rust facade::

    import kvlane

    layout = kvlane.KvLayout(layers=2, blocks=16, block_bytes=4096)
    kv = kvlane.host_buffer(layout.required_len)  # or any writable buffer
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
from kvlane._memory import host_buffer

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
    "host_buffer",
]
