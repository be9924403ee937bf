"""vLLM's P2P KV-offload tier on kvlane: ``kvlane.vllm.KvlaneP2PTier``.

vLLM's OffloadingConnector runs a peer-to-peer secondary tier
(``vllm/v1/kv_offload/tiering/p2p``) whose manager hard-codes a ZMQ control
transport and a NIXL data transport. This module gives that tier kvlane's
transports, selected with one entry of ``secondary_tiers``::

    {"type": "KvlaneP2PTier", "module_path": "kvlane.vllm",
     "host": "10.0.0.5", "port": 5710, "kvlane": {"psk": "..."}}

Everything else (sessions, protocol, timeouts, the manager's bookkeeping)
is vLLM's own code, unchanged. The pieces:

- :class:`KvlaneControlTransport` / :class:`KvlaneControlConnection`
  (``control/base.py``): control messages are kvlane notifications over the
  agent's control plane. A connection is named by the remote's listen
  address (its kvlane ``engine_id`` is that ``host:port``). Every message
  carries the sender's and the receiver's kvlane incarnations, so a peer
  that restarted is a new connection at once (its first message is never
  dropped, and never handed to the session of its previous process) and a
  message meant for an earlier process at this address is dropped.
- :class:`KvlaneDataTransport` (``data/base.py``): the tier's memoryview is
  registered with the agent; ``write_blocks`` is one kvlane WRITE of every
  block; ``poll(peer_id)`` reports that peer's transfers; a transfer is only
  ever posted to the incarnation the peer's session handshook with.
- :class:`KvlaneP2PTier`: vLLM's ``P2PSecondaryTierManager`` built with
  these transports (no ZMQ socket is bound, NIXL is not touched), one kvlane
  agent per tier listening on the tier's ``host:port``, and a restarted
  peer's new connection accepted in the poll that received it.

- :class:`CpuTieringOffloadingSpec`: vLLM's ``TieringOffloadingSpec``
  with a worker for the CPU platform (``memmove`` between the KV cache and
  the tier's ``/dev/shm`` region), where vLLM 0.32's own worker refuses to
  run; loaded with ``"spec_name": "CpuTieringOffloadingSpec",
  "spec_module_path": "kvlane.vllm"``.

Threads: vLLM drives everything from ``poll()`` on its scheduler thread and
nothing here blocks it. kvlane's own runtime does the I/O; the one blocking
call, ``Agent.connect`` (the handshake), runs on a small pool
(``DIAL_THREADS``) whose results are collected by ``poll()``.
"""


from .control import KvlaneControlConnection, KvlaneControlTransport
from .cpu import CpuTieringOffloadingSpec
from .data import KvlaneDataTransport
from .tier import KvlaneP2PTier

__all__ = [
    "CpuTieringOffloadingSpec",
    "KvlaneControlConnection",
    "KvlaneControlTransport",
    "KvlaneDataTransport",
    "KvlaneP2PTier",
]
