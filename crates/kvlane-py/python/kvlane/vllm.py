"""vLLM KV connector on kvlane: ``kvlane.vllm.KvlaneConnector``.

vLLM loads it from outside its own tree, with one line of configuration::

    --kv-transfer-config '{"kv_connector": "KvlaneConnector",
                           "kv_connector_module_path": "kvlane.vllm",
                           "kv_role": "kv_producer"}'    # "kv_consumer" on decode

It runs vLLM's own NixlConnector protocol (pull: decode READs prefill's
blocks, the side-channel handshake, notifications, heartbeats and leases,
``kv_load_failure_policy``) with kvlane as the transport: the scheduler side
is vLLM's, unchanged; the worker side is vLLM's NIXL worker with its NIXL
agent replaced by :class:`kvlane.nixl.nixl_agent`. The swap is local to this
connector's worker: a real NIXL installed beside kvlane is neither shadowed
nor imported, and a ``NixlConnector`` in the same deployment keeps using it.

kvlane settings come from the environment (``KVLANE_*``, see
:mod:`kvlane.nixl`) or from ``kv_connector_extra_config["kvlane"]``, a dict
of :class:`kvlane.nixl.nixl_agent_config` keywords (``backend``,
``listen_host``, ``advertise_host``, ``psk``, liveness settings, ``cpus``);
the config wins over the environment. On one host nothing needs setting.
kvlane's threads run on every CPU of the process (``cpus="all"``, see
``DEFAULT_CPUS``), not on the core vLLM's CPU worker narrows its own thread
to; ``cpus="inherit"`` (or ``KVLANE_CPUS=inherit``) keeps vLLM's placement.
The worker's own thread gets back the CPUs it had before that narrowing
(``DEFAULT_MODEL_THREAD_CPUS``); ``model_thread_cpus="vllm"`` (or
``KVLANE_VLLM_MODEL_THREAD_CPUS=vllm``) leaves it narrowed.
A peer is dead after 10 s of silence (``liveness_budget`` 9, see
``DEFAULT_LIVENESS_BUDGET``); one that exits fails its transfers at once.
Across hosts, every engine needs ``listen_host`` (``"0.0.0.0"`` or an
address its peers reach) and the same ``psk`` (or ``KVLANE_PSK``).

vLLM's P2P KV-offload tier on kvlane is ``KvlaneP2PTier`` (with its
transports ``KvlaneControlTransport``, ``KvlaneControlConnection`` and
``KvlaneDataTransport``), one entry of the OffloadingConnector's
``secondary_tiers``: ``{"type": "KvlaneP2PTier", "module_path":
"kvlane.vllm"}``; see ``kvlane._vllm_p2p``. On the CPU platform the
OffloadingConnector's spec is ``CpuTieringOffloadingSpec`` (``"spec_name":
"CpuTieringOffloadingSpec", "spec_module_path": "kvlane.vllm"``): vLLM
0.32's ``TieringOffloadingSpec`` with a worker that copies with
``memmove``, where vLLM's own refuses non-CUDA platforms.

Supported vLLM: the 0.32 series (``SUPPORTED_VLLM``). Another version fails
at load with a message naming it; ``KVLANE_VLLM_ANY_VERSION=1`` tries anyway.
"""

from __future__ import annotations

import os
import types
from typing import Any, Callable, Dict, Optional

try:
    import vllm
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker import (
        NixlBaseConnectorWorker,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (
        NixlBaseConnector,
        NixlPullConnector,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import (
        NixlPullConnectorScheduler,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import (
        NixlPullConnectorWorker,
    )
except ImportError as e:  # pragma: no cover - exercised without vLLM only
    raise ImportError(f"kvlane.vllm needs vLLM 0.32.x installed (import failed: {e})") from e

from kvlane import nixl as _nixl

__all__ = [
    "CpuTieringOffloadingSpec",
    "KvlaneConnector",
    "KvlaneConnectorWorker",
    "KvlaneControlConnection",
    "KvlaneControlTransport",
    "KvlaneDataTransport",
    "KvlaneP2PTier",
    "SUPPORTED_VLLM",
]

#: vLLM release series this connector is tested with (ci/vllm.sh).
SUPPORTED_VLLM = ("0.32",)


def _check_version(version: str = vllm.__version__) -> None:
    series = ".".join(version.split(".")[:2])
    if series in SUPPORTED_VLLM or os.environ.get("KVLANE_VLLM_ANY_VERSION") == "1":
        return
    raise RuntimeError(
        f"kvlane.vllm: vLLM {version} is not supported (KvlaneConnector is built and "
        f"tested against vLLM {', '.join(s + '.x' for s in SUPPORTED_VLLM)}); install a "
        "supported vLLM, or set KVLANE_VLLM_ANY_VERSION=1 to try this one anyway"
    )


#: Where kvlane's threads run in a vLLM worker unless ``cpus`` or
#: ``KVLANE_CPUS`` says otherwise: every CPU of the process, not the one core
#: vLLM's CPU worker narrows its own thread to before it builds the agent
#: (the last core of each NUMA node, the same core for every engine on the
#: host, where that thread also drives the model). Measured on a 2-vCPU VM
#: with two engines: runnable kvlane threads on that core waited up to 10 s
#: for it (``/proc/<pid>/task/*/schedstat``: run time flat for seconds while
#: the state was R), longer than the liveness budget, so a live peer was
#: declared dead; with ``"all"`` they run where the kernel finds room.
DEFAULT_CPUS = "all"

#: Unanswered keep-alive pings (one a second by default) before a peer of a
#: vLLM worker is dead, unless ``liveness_budget`` or
#: ``KVLANE_LIVENESS_BUDGET`` says otherwise: 9, so a peer silent for 10 s
#: is dead (kvlane's own default is 3, 4 s). A CPU engine's process can go
#: unscheduled for seconds on a busy host (7 s seen here with ``"all"``,
#: 10 s on vLLM's narrowed core), and a live engine must not lose its KV
#: loads for it. A peer that exits or crashes is not waited for: the kernel
#: closes its connections and its transfers fail at once; the budget only
#: bounds a peer that stopped (SIGSTOP, a hung host, a lost link).
DEFAULT_LIVENESS_BUDGET = 9


#: Where the worker's own thread (the one that drives the model) runs once
#: the connector is built, unless ``model_thread_cpus`` or
#: ``KVLANE_VLLM_MODEL_THREAD_CPUS`` says ``"vllm"``: ``"restore"`` gives it
#: back the CPUs it had before vLLM's NIXL worker ``__init__`` narrowed it to
#: the last core of each NUMA node (on CPU, 0.32). That narrowing puts the
#: OpenMP master thread on the core of another OpenMP thread of the same
#: team, and every parallel region then waits for the scheduler: measured
#: on a 2-vCPU VM, a 100-token prefill call took 310-470 ms narrowed and
#: 14 ms restored, a 6-token decode of a 5-token prompt 1.46 s narrowed (the
#: same with the real NIXL). The thread gets back exactly the placement
#: vLLM's CPU worker gave it (``VLLM_CPU_OMP_THREADS_BIND``).
DEFAULT_MODEL_THREAD_CPUS = "restore"


def _agent_config(extra: Dict[str, Any]) -> Callable[..., Any]:
    """A ``nixl_agent_config`` for vLLM's worker: vLLM's own arguments
    (threads, telemetry) plus the deployment's kvlane settings."""
    if not isinstance(extra, dict):
        raise ValueError(
            "kvlane.vllm: kv_connector_extra_config['kvlane'] must be a dict of "
            f"kvlane.nixl.nixl_agent_config keywords, not {type(extra).__name__}"
        )

    def make(*args: Any, **kwargs: Any) -> Any:
        settings = {**kwargs, **extra}
        if settings.get("cpus") is None and not os.environ.get("KVLANE_CPUS"):
            settings["cpus"] = DEFAULT_CPUS
        if (settings.get("liveness_budget") is None
                and not os.environ.get("KVLANE_LIVENESS_BUDGET")):
            settings["liveness_budget"] = DEFAULT_LIVENESS_BUDGET
        try:
            return _nixl.nixl_agent_config(*args, **settings)
        except TypeError as e:
            raise ValueError(
                f"kvlane.vllm: bad kv_connector_extra_config['kvlane'] {sorted(extra)}: {e}"
            ) from e

    return make


def _with_globals(fn: Any, **names: Any) -> Any:
    """``fn`` with some of its module's global names bound to other objects,
    for this copy only: the module and every other caller are unchanged."""
    missing = [n for n in names if n not in fn.__code__.co_names]
    if missing:
        raise RuntimeError(
            f"kvlane.vllm: {fn.__qualname__} of vLLM {vllm.__version__} no longer uses "
            f"{missing}; this vLLM is not supported by this kvlane"
        )
    g = dict(fn.__globals__)
    g.update(names)
    new = types.FunctionType(fn.__code__, g, fn.__name__, fn.__defaults__, fn.__closure__)
    new.__kwdefaults__ = fn.__kwdefaults__
    new.__qualname__ = fn.__qualname__
    new.__doc__ = fn.__doc__
    return new


_base_init = NixlBaseConnectorWorker.__init__


def _restore_placement(extra: Dict[str, Any]) -> bool:
    """Whether the worker's thread gets its CPUs back after vLLM's NIXL
    worker narrowed it (``model_thread_cpus``, ``KVLANE_VLLM_MODEL_THREAD_CPUS``:
    ``"restore"``, the default, or ``"vllm"``); pops the key from ``extra``."""
    value = extra.pop("model_thread_cpus", None)
    if value is None:
        value = os.environ.get("KVLANE_VLLM_MODEL_THREAD_CPUS") or DEFAULT_MODEL_THREAD_CPUS
    if value not in ("restore", "vllm"):
        raise ValueError(
            "kvlane.vllm: model_thread_cpus (or KVLANE_VLLM_MODEL_THREAD_CPUS) is "
            f"\"restore\" or \"vllm\", not {value!r}"
        )
    return value == "restore"


class _KvlaneBaseWorker(NixlBaseConnectorWorker):
    """vLLM's NIXL worker base whose agent is a kvlane.nixl agent."""

    def __init__(self, vllm_config: Any, engine_id: str, kv_cache_config: Any) -> None:
        raw = vllm_config.kv_transfer_config.get_from_extra_config("kvlane", {}) or {}
        _agent_config(raw)  # a clear error for anything but a dict
        extra = dict(raw)
        restore = _restore_placement(extra)
        make_config = _agent_config(extra)
        init = _with_globals(
            _base_init,
            NixlWrapper=_nixl.nixl_agent,
            nixl_agent_config=make_config,
        )
        before = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
        init(self, vllm_config, engine_id, kv_cache_config)
        if restore and before is not None and os.sched_getaffinity(0) != before:
            os.sched_setaffinity(0, before)


class KvlaneConnectorWorker(NixlPullConnectorWorker, _KvlaneBaseWorker):
    """vLLM's pull worker (``NixlPullConnectorWorker``) over kvlane.

    The method resolution order puts ``_KvlaneBaseWorker`` between vLLM's
    pull worker and its base, so the pull worker's ``super().__init__``
    builds the kvlane agent."""


class KvlaneConnector(NixlPullConnector):
    """vLLM's ``NixlConnector`` (pull) with kvlane as its transport."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Optional[Any] = None):
        _check_version()
        # NixlPullConnector.__init__ would build vLLM's NIXL worker; build
        # the same parts with the kvlane worker instead.
        NixlBaseConnector.__init__(self, vllm_config, role, kv_cache_config)
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = NixlPullConnectorScheduler(
                vllm_config, self.engine_id, kv_cache_config
            )
            self.connector_worker = None
        elif role == KVConnectorRole.WORKER:
            self.connector_scheduler = None
            self.connector_worker = KvlaneConnectorWorker(
                vllm_config, self.engine_id, kv_cache_config
            )
        else:
            raise ValueError(f"kvlane.vllm: unsupported KVConnectorRole {role!r}")


#: The P2P KV-offload tier (``secondary_tiers: [{"type": "KvlaneP2PTier",
#: "module_path": "kvlane.vllm"}]``) and its transports, from
#: ``kvlane._vllm_p2p``; imported when first named, so the connector above
#: loads without vLLM's P2P tier code.
_P2P_NAMES = frozenset(
    ("KvlaneP2PTier", "KvlaneControlTransport", "KvlaneControlConnection", "KvlaneDataTransport",
     "CpuTieringOffloadingSpec")
)


def __getattr__(name: str) -> Any:
    if name in _P2P_NAMES:
        from kvlane import _vllm_p2p

        return getattr(_vllm_p2p, name)
    raise AttributeError(f"module 'kvlane.vllm' has no attribute {name!r}")
