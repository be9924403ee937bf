"""``KvlaneP2PTier``: vLLM's P2P secondary tier manager with kvlane's
transports."""

from __future__ import annotations

import os
from typing import Any, Dict, Iterable, Optional, Sequence, Tuple

import kvlane
from vllm.v1.kv_offload.tiering.p2p.control.base import ControlConnection, ControlTransport
from vllm.v1.kv_offload.tiering.p2p.data.base import DataTransport
from vllm.v1.kv_offload.tiering.base import JobResult, TransferJob
from vllm.v1.kv_offload.tiering.p2p.manager import P2PSecondaryTierManager, P2PSourceInfo

from .control import KvlaneControlTransport
from .data import KvlaneDataTransport, TransferCounts
from .link import Dialer

_AGENT_KEYS = ("backend", "listen", "advertise", "psk", "keepalive_interval",
               "liveness_budget", "handshake_timeout", "transfer_deadline", "cpus")


def _agent_settings(raw: Any) -> Dict[str, Any]:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ValueError(f"kvlane.vllm.KvlaneP2PTier: the tier's 'kvlane' entry is a dict of "
                         f"{', '.join(_AGENT_KEYS)}, not {type(raw).__name__}")
    unknown = sorted(set(raw) - set(_AGENT_KEYS))
    if unknown:
        raise ValueError(f"kvlane.vllm.KvlaneP2PTier: unknown 'kvlane' settings {unknown}; "
                         f"known: {', '.join(_AGENT_KEYS)}")
    s = dict(raw)
    psk = s.get("psk") or os.environ.get("KVLANE_PSK")
    if isinstance(psk, str):
        psk = psk.encode()
    s["psk"] = psk or None
    s.setdefault("backend", os.environ.get("KVLANE_BACKEND", "auto"))
    return s


class KvlaneP2PTier(P2PSecondaryTierManager):
    """vLLM's P2P secondary tier with kvlane as its control and data
    transports (see the module's doc). Configuration: vLLM's P2P tier keys
    (``host``, ``port``, ``unbound_store_timeout_s``; NIXL's ``backends`` and
    ``num_threads`` are ignored) plus ``kvlane``, a dict of agent settings
    (``backend``, ``psk``, ``listen`` (default ``host:port``), ``advertise``,
    ``liveness_budget``, ``keepalive_interval``, ``handshake_timeout``,
    ``transfer_deadline``, ``cpus``); ``KVLANE_PSK`` and ``KVLANE_BACKEND``
    are read when the dict does not say.

    Counts (``TransferCounts``, as transfers end): ``loaded``, the blocks
    this tier's loads fetched from peers, and ``written``, the blocks it
    wrote to peers that fetched from it; each per peer id. On the CPU
    platform the OffloadingConnector's spec is
    :class:`CpuTieringOffloadingSpec`."""

    def __init__(self, offloading_spec: Any, primary_kv_view: memoryview,
                 tier_type: str = "KvlaneP2PTier", host: Optional[str] = None,
                 port: Optional[int] = None, kvlane: Optional[dict] = None,
                 **kwargs: Any) -> None:
        from kvlane.vllm import _with_globals  # the module re-exports this one

        settings = _agent_settings(kvlane)
        self._kvlane_agent: Optional[Any] = None
        self._kvlane_dialer: Optional[Dialer] = None
        #: Loads from peers (jobs and blocks), as they ended; what this tier
        #: wrote to peers is ``written``.
        self.loaded = TransferCounts()
        self._loads: Dict[int, Tuple[str, int]] = {}  # job id -> (peer id, blocks)

        def make_data(agent_name: str, view: memoryview, config_fields: Optional[dict] = None,
                      **_nixl: Any) -> DataTransport:
            # vLLM's constructor calls this first, after setting _local_id.
            agent = _make_agent(self._local_id, settings)
            self._kvlane_agent = agent
            self._kvlane_dialer = Dialer(agent)
            # Peers reach the data plane at the peer id unless the agent
            # listens elsewhere.
            advertise = settings.get("advertise") or (agent.addr if settings.get("listen")
                                                      else None)
            return KvlaneDataTransport(agent, view, config_fields, self._kvlane_dialer,
                                       advertise=advertise)

        init = _with_globals(P2PSecondaryTierManager.__init__,
                             NixlTransport=make_data, ZmqTransport=self._make_control)
        try:
            init(self, offloading_spec, primary_kv_view, tier_type, host, port, **kwargs)
        except BaseException:
            self._close_agent()
            raise

    def _make_control(self, local_id: str, host: str, port: int) -> ControlTransport:
        """The control transport (vLLM's constructor calls it after the
        data transport's, in place of ``ZmqTransport(local_id, host, port)``)."""
        assert self._kvlane_agent is not None and self._kvlane_dialer is not None
        return KvlaneControlTransport(self._kvlane_agent, self._kvlane_dialer)

    @property
    def kvlane_agent(self) -> Any:
        """The tier's kvlane agent (engine id and listen address ``host:port``)."""
        return self._kvlane_agent

    @property
    def written(self) -> TransferCounts:
        """Blocks this tier wrote to peers (their loads from it), as they ended."""
        data = self._data
        return data.written if isinstance(data, KvlaneDataTransport) else TransferCounts()

    def submit_load(self, job_metadata: TransferJob) -> None:
        source = job_metadata.req_context.get_state(P2PSourceInfo)
        peer = source.peer_id if source is not None else "?"
        self._loads[job_metadata.job_id] = (peer, len(job_metadata.keys))
        super().submit_load(job_metadata)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        results = list(super().get_finished_jobs())
        for r in results:
            load = self._loads.pop(r.job_id, None)
            if load is not None:
                self.loaded.count(load[0], load[1], r.success)
        return results

    def _accept_new_peers(self, new_connections: Sequence[ControlConnection]) -> None:
        # A restarted peer's new connection arrives in the poll that finds
        # its old one dead; vLLM reaps dead sessions only at the end of the
        # poll and would refuse the new one as a duplicate (the peer then
        # waits for its handshake timeout). Reap first.
        if new_connections:
            self._reap_dead_sessions()
        super()._accept_new_peers(new_connections)

    def shutdown(self) -> None:
        try:
            super().shutdown()
        finally:
            self._close_agent()

    def _close_agent(self) -> None:
        if self._kvlane_dialer is not None:
            self._kvlane_dialer.close()
        if self._kvlane_agent is not None:
            self._kvlane_agent.close()


def _make_agent(local_id: str, s: Dict[str, Any]) -> Any:
    kw = {k: s[k] for k in ("advertise", "keepalive_interval", "liveness_budget",
                            "handshake_timeout", "transfer_deadline", "cpus")
          if s.get(k) is not None}
    try:
        return kvlane.Agent(engine_id=local_id, listen=s.get("listen") or local_id,
                            backend=s["backend"], psk=s["psk"], **kw)
    except kvlane.Error as e:
        raise ValueError(f"kvlane.vllm.KvlaneP2PTier: cannot start a kvlane agent on "
                         f"{s.get('listen') or local_id}: {e}") from e

