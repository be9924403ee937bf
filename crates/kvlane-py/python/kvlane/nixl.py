"""A NIXL-compatible agent on kvlane: ``nixl_agent`` and ``nixl_agent_config``.

An engine connector written for NIXL (``from nixl._api import nixl_agent``)
switches transport by importing these names from ``kvlane.nixl`` instead.
The subset implemented is what vLLM's NixlConnector and SGLang's NIXL
backend call; any other ``nixl_agent`` attribute raises
``NotImplementedError`` naming it.

Mapping onto kvlane
-------------------

* ``nixl_agent_config(backends=["UCX"], num_threads=..., capture_telemetry=...,
  enable_prog_thread=..., enable_listen_thread=..., listen_port=...)``:
  every NIXL backend name maps to kvlane's best backend (``"auto"``: shm
  to peers on this host when the registered memory allows it, see below;
  else verbs when a device is usable, else tcp); ``backend=`` (or
  ``KVLANE_BACKEND``)
  names a kvlane backend instead. ``num_threads``, ``enable_prog_thread``,
  ``enable_listen_thread`` and ``sync_mode`` mean nothing here (kvlane's
  progress and listener threads always run, and it is thread-safe) and are
  ignored; telemetry is always
  captured. ``listen_port`` is the control port (0: any); ``listen_host``
  (or ``KVLANE_NIXL_HOST``, default ``127.0.0.1``) is the host it binds and
  advertises in the metadata; ``psk`` (or ``KVLANE_PSK``, as for the
  ``kvlane`` binary) authenticates handshakes, and binding anything but a
  loopback address without one warns (``RuntimeWarning``: whoever reaches
  the port can then read and write the registered memory). Across
  hosts, set ``listen_host`` to this host's address on the network peers
  use; or bind a wildcard (``0.0.0.0``, ``::``) and name that address in
  ``advertise_host`` (or ``KVLANE_ADVERTISE``; ``KVLANE_NIXL_ADVERTISE`` is
  its older name): it goes into the
  metadata and is the data plane's advertised host. A wildcard without it
  makes ``get_agent_metadata`` raise ``kvlane.InvalidInputError`` (the
  metadata would tell peers to dial ``0.0.0.0``), and ``add_remote_agent``
  refuses metadata that carries a wildcard.
* kvlane's settings, keyword-only on ``nixl_agent_config``, each also read
  from the environment (an explicit argument wins; an empty variable
  counts as unset; a bad value raises ``ValueError`` naming the argument
  or variable and the value; unset means kvlane's default):

  ===========================  ==================================  ===============
  argument                     variable                            default
  ===========================  ==================================  ===============
  ``keepalive_interval``       ``KVLANE_KEEPALIVE_INTERVAL``       1 s
  ``liveness_budget``          ``KVLANE_LIVENESS_BUDGET``          3 missed pings
  ``handshake_timeout``        ``KVLANE_HANDSHAKE_TIMEOUT``        5 s
  ``transfer_deadline``        ``KVLANE_TRANSFER_TIMEOUT``         30 s
  ``backend``                  ``KVLANE_BACKEND``                  ``"auto"``
  ``shm_cross_memory_attach``  ``KVLANE_SHM_CROSS_MEMORY_ATTACH``  off
  ``psk``                      ``KVLANE_PSK``                      none
  ``listen_host``              ``KVLANE_NIXL_HOST``                ``127.0.0.1``
  ``advertise_host``           ``KVLANE_ADVERTISE``                the listen host
  ===========================  ==================================  ===============

  Durations are seconds (a number) or strings such as ``"250ms"``,
  ``"2s"``, ``"1m"``; the liveness budget is the number of consecutive
  unanswered keep-alive pings after which a peer is dead (its transfers
  then fail: with the defaults, within about 3 s). ``cpus`` (``"inherit"``,
  ``"all"`` or a CPU list such as ``"0-3,8"``) places kvlane's threads; it
  is passed to ``kvlane.Agent(cpus=...)`` only when given, and
  ``kvlane.Agent`` reads ``KVLANE_CPUS`` itself (kvlane versions without
  CPU placement raise ``TypeError`` for it).
* Peers on this host: ``"auto"`` (the default) adds shared memory for
  peers on this host (same kernel and network namespace) when the
  registered memory allows it, ``"same-host"`` is the same (also with
  ``KVLANE_SAME_HOST_SHM=0``), ``backend="shm"`` uses it alone.
  ``"VRAM"`` (GPU memory) is served by CUDA/HIP IPC handle, which hands
  a peer's driver the whole allocation holding it (tested only against a
  mock driver, not on a GPU). Registered ``"DRAM"`` here is always memory
  Python allocated (numpy, torch, ``kvlane.host_buffer``), which shm
  serves only with
  ``shm_cross_memory_attach`` (or ``KVLANE_SHM_CROSS_MEMORY_ATTACH=1``):
  peers then copy into and out of this process with
  ``process_vm_readv``/``process_vm_writev``. **This exposes the whole
  process**, not only the registered memory, to every process the kernel
  lets attach to it (the same user while the process is dumpable, or
  root); kvlane keeps well-behaved peers inside the registrations and
  their rights, nothing holds a hostile one. Without it ``"shm"`` raises
  ``kvlane.UnsupportedError`` when the agent is built, and ``"auto"`` and
  ``"same-host"`` serve every peer over tcp or verbs (the reason is
  logged at ``info``: ``KVLANE_LOG=info``).
* ``register_memory``: descriptors become kvlane plain regions
  (``AgentBuilder::register_region``). The kvlane agent is built, with
  everything registered so far, at the first call that needs it
  (``get_agent_metadata``, ``add_remote_agent``, ``prep_xfer_dlist``).
  Memory registered after that (``Agent::register_region``) is usable
  locally at once and is in every later handshake; as with NIXL, peers
  learn it from newer metadata: publish ``get_agent_metadata()`` again and
  have them ``add_remote_agent`` it (an agent already added is then
  connected again; its transfers still in flight end in ``"ERR"``).
  ``deregister_memory`` (matched by address and length, as in
  NIXL) before the build drops the registration;
  after it, the memory can no longer be used in local descriptor lists,
  but stays registered (and must stay allocated) until the agent closes.
* ``get_agent_metadata``: the agent's name, control address, incarnation
  and how many registrations it made since it was built.
  ``add_remote_agent`` connects from those bytes alone (handshake and data
  plane) and returns the peer's name (as bytes, like NIXL; names are
  accepted as str or bytes everywhere); adding the same metadata again is
  a no-op, newer metadata of an added agent connects again.
  ``remove_remote_agent`` disconnects synchronously.
* ``check_remote_metadata(name, descs=None)``: True while the agent's
  metadata is loaded and still describes a live process: False for an
  agent never added or removed, once keep-alive declared it dead, and
  once it restarted (a new incarnation: its memory moved), until it is
  removed and added again with its new metadata. With ``descs`` (any form
  ``get_xfer_descs`` takes), also whether every descriptor lies in memory
  it advertised. vLLM calls it after a failed transfer and drops the
  engine (then handshakes again) when it is False. It never raises for
  an unknown name and never blocks.
* ``prep_xfer_dlist`` checks every descriptor against the registrations
  (local, or those the remote agent advertised) and raises
  ``kvlane.InvalidInputError`` for one outside them.
  ``make_prepped_xfer`` / ``initialize_xfer`` plan the transfer
  (``Peer.prepare_spans``: equal lengths pair by pair, rights, merged
  contiguous runs) and raise for bad input; ``transfer`` posts it.
* ``check_xfer_state``: ``"DONE"``, ``"PROC"`` or ``"ERR"``. Every kvlane
  transfer has a deadline (``transfer_deadline``, 30 s) and a dead peer
  fails its transfers within the liveness budget, so nothing stays
  ``"PROC"`` forever. A failed transfer is ``"ERR"`` (from ``transfer``
  when its post is refused because the peer is gone, else from
  ``check_xfer_state``), as NIXL's Python API reports it; bad input
  raises. vLLM treats ``"ERR"`` and an exception alike: it fails the
  request (its blocks reported by ``get_block_ids_with_load_errors``),
  releases the handle (never raises here) and asks
  ``check_remote_metadata``. ``check_xfer_state`` and ``get_new_notifs``
  are what engines call every step: about a microsecond each with nothing
  pending; neither blocks, sleeps nor releases the GIL (``"PROC"`` yields
  the core once, keeping the GIL, for callers that poll in a loop).
* Notifications (``notif_msg``, ``send_notif``) reach the target keyed by
  the initiator's name, after every descriptor landed (READ too: the
  notification is sent once the data is at the initiator).
  ``get_new_notifs`` returns ``{agent_name: [bytes, ...]}``.
* Handles are ``nixl_xfer_handle`` / ``nixl_prepped_dlist_handle`` objects
  with ``release()``; releasing twice is a no-op, using a released handle
  raises ``kvlane.InvalidInputError``. Releasing a running transfer lets it
  run to its end (kvlane cannot abort a posted transfer).
* Host memory (``"DRAM"``/``"cpu"``) and GPU memory (``"VRAM"``/``"cuda"``):
  torch CUDA tensors, CuPy arrays (``__cuda_array_interface__``) and
  ``(addr, len, gpu_id)`` rows. GPU memory is registered as GPU memory of
  the device the driver names (checked), never as host memory; tcp and
  loopback stage it through pinned host buffers. Without a GPU driver or
  device, registering VRAM raises ``kvlane.UnsupportedError`` naming the
  device and why. ROCm builds of torch register as ``rocm:N``; rows
  without torch (or with a CPU-only torch) are memory of CUDA device
  ``gpu_id`` where the CUDA driver loads, else of ROCm device ``gpu_id``.
"""

import ipaddress
import itertools
import json
import math
import os
import re
import sys
import logging
import warnings
from typing import Any, Dict, List, Optional, Sequence, Union

import numpy as np

import kvlane

_log = logging.getLogger("kvlane.nixl")

__all__ = ["nixl_agent", "nixl_agent_config", "nixl_xfer_handle", "nixl_prepped_dlist_handle"]


class _Handle:
    """An opaque handle (NIXL's handle classes): ``release()`` frees it
    (again: a no-op); using it afterwards raises ``kvlane.InvalidInputError``."""

    __slots__ = ("_handle", "_agent", "_released")
    _what = "handle"

    def __init__(self, agent: "nixl_agent", value: int) -> None:
        self._handle = value
        self._agent = agent
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._agent._release(self)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._handle:#x}, released={self._released})"


class nixl_xfer_handle(_Handle):
    """A transfer request (``make_prepped_xfer``, ``initialize_xfer``).
    Releasing a running transfer lets it run to its end."""

    __slots__ = ()
    _what = "transfer handle"


class nixl_prepped_dlist_handle(_Handle):
    """A prepared descriptor list (``prep_xfer_dlist``)."""

    __slots__ = ()
    _what = "dlist handle"

_LOCAL = "NIXL_INIT_AGENT"
_HOST_MEM = ("DRAM", "cpu", None)
_GPU_MEM = ("VRAM", "cuda")
_SUBSET = (
    "get_reg_descs register_memory deregister_memory get_agent_metadata add_remote_agent "
    "remove_remote_agent get_xfer_descs prep_xfer_dlist release_dlist_handle make_prepped_xfer "
    "initialize_xfer transfer check_xfer_state get_xfer_telemetry release_xfer_handle "
    "get_new_notifs update_notifs check_remote_xfer_done send_notif check_remote_metadata name"
)


_BACKENDS = ("auto", "tcp", "verbs", "loopback", "shm", "same-host")
_DURATION = re.compile(r"([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)(ms|s|m)?")
_UNIT = {"ms": 1e-3, "s": 1.0, "m": 60.0, None: 1.0}


def _duration(value: Any, what: str) -> float:
    """Seconds of a positive duration: a number of seconds, or a string
    like ``"250ms"``, ``"2s"``, ``"1m"`` (a bare number is seconds);
    ``ValueError`` naming ``what`` and the value otherwise."""
    secs: Optional[float] = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        secs = float(value)
    elif isinstance(value, str):
        m = _DURATION.fullmatch(value.strip())
        if m:
            secs = float(m.group(1)) * _UNIT[m.group(2)]
    if secs is None or not math.isfinite(secs) or secs <= 0:
        raise ValueError(
            f"kvlane.nixl: {what} is a positive duration such as 250ms, 2s or 1m, not {value!r}"
        )
    return secs


def _count(value: Any, what: str) -> int:
    """A positive whole number (an int, or its decimal string)."""
    try:
        n = int(value.strip()) if isinstance(value, str) else value
    except ValueError:
        n = None
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"kvlane.nixl: {what} is a positive whole number, not {value!r}")
    return n


def _setting(arg: Any, arg_name: str, env: str, parse: Any) -> Any:
    """An explicit argument (wins), else the environment variable, else
    None (kvlane's default); parsed, a bad value naming its source."""
    if arg is not None:
        return parse(arg, arg_name)
    raw = os.environ.get(env)
    if raw is None or raw.strip() == "":
        return None
    return parse(raw, env)


def _flag(value: Any, what: str) -> bool:
    """A boolean: True/False, or ``1``/``0``, ``true``/``false``,
    ``yes``/``no``, ``on``/``off`` (any case) from the environment."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        v = value.strip().lower()
        if v in ("1", "true", "yes", "on"):
            return True
        if v in ("0", "false", "no", "off"):
            return False
    raise ValueError(f"kvlane.nixl: {what} is true or false (1/0, yes/no, on/off), not {value!r}")


def _backend(value: Any, what: str) -> str:
    if value not in _BACKENDS:
        raise ValueError(
            f"kvlane.nixl: {what} is one of {', '.join(map(repr, _BACKENDS))}, not {value!r}"
        )
    return value


class nixl_agent_config:
    """NIXL's agent configuration, plus kvlane's settings (keyword-only;
    each also read from its environment variable, the argument winning).
    See the module docstring for the mapping. A bad value, given or from
    the environment, raises ``ValueError`` naming the argument or the
    variable and the value."""

    def __init__(
        self,
        enable_prog_thread: bool = True,
        enable_listen_thread: bool = False,
        listen_port: int = 0,
        capture_telemetry: bool = False,
        num_threads: int = 0,
        backends: Sequence[str] = ("UCX",),
        sync_mode: Any = None,
        *,
        backend: Optional[str] = None,
        listen_host: Optional[str] = None,
        psk: Optional[Union[bytes, str]] = None,
        advertise_host: Optional[str] = None,
        keepalive_interval: Any = None,
        liveness_budget: Optional[int] = None,
        handshake_timeout: Any = None,
        transfer_deadline: Any = None,
        cpus: Optional[str] = None,
        shm_cross_memory_attach: Optional[bool] = None,
    ) -> None:
        self.enable_pthread = enable_prog_thread
        self.enable_listen = enable_listen_thread
        self.port = listen_port
        self.capture_telemetry = capture_telemetry
        self.num_threads = num_threads
        self.backends = list(backends)
        self.sync_mode = sync_mode  # kvlane's agent is thread-safe in every mode
        self.backend = _setting(backend, "backend", "KVLANE_BACKEND", _backend) or "auto"
        self.listen_host = listen_host or os.environ.get("KVLANE_NIXL_HOST", "127.0.0.1")
        self.advertise_host = advertise_host or _advertise_env()
        env_psk = os.environ.get("KVLANE_PSK")
        if isinstance(psk, str):  # from JSON configs (kvlane.vllm's extra config)
            psk = psk.encode()
        self.psk = psk if psk is not None else (env_psk.encode() if env_psk else None)
        # None: kvlane's default (keep-alive every 1 s, dead after 3 missed
        # pings, 5 s handshakes, 30 s transfer deadline).
        self.keepalive_interval = _setting(
            keepalive_interval, "keepalive_interval", "KVLANE_KEEPALIVE_INTERVAL", _duration)
        self.liveness_budget = _setting(
            liveness_budget, "liveness_budget", "KVLANE_LIVENESS_BUDGET", _count)
        self.handshake_timeout = _setting(
            handshake_timeout, "handshake_timeout", "KVLANE_HANDSHAKE_TIMEOUT", _duration)
        self.transfer_deadline = _setting(
            transfer_deadline, "transfer_deadline", "KVLANE_TRANSFER_TIMEOUT", _duration)
        # Forwarded as is; kvlane.Agent validates it and reads KVLANE_CPUS
        # itself when it is None.
        self.cpus = cpus
        # Opt-in: exposes the whole process to same-user peers (see the
        # module docstring); passed to kvlane.Agent only when on.
        self.shm_cross_memory_attach = _setting(
            shm_cross_memory_attach, "shm_cross_memory_attach",
            "KVLANE_SHM_CROSS_MEMORY_ATTACH", _flag) or None

    def _agent_kwargs(self) -> Dict[str, Any]:
        """kvlane.Agent keywords for the settings given (others: its defaults)."""
        kw = {k: getattr(self, k) for k in (
            "keepalive_interval", "liveness_budget", "handshake_timeout", "transfer_deadline", "cpus",
            "shm_cross_memory_attach")}
        return {k: v for k, v in kw.items() if v is not None}


def _advertise_env() -> Optional[str]:
    """``KVLANE_ADVERTISE``, or its older name ``KVLANE_NIXL_ADVERTISE``."""
    new = os.environ.get("KVLANE_ADVERTISE") or None
    old = os.environ.get("KVLANE_NIXL_ADVERTISE") or None
    if new and old and new != old:
        raise ValueError(
            f"kvlane.nixl: KVLANE_ADVERTISE={new!r} and its older name KVLANE_NIXL_ADVERTISE={old!r} "
            "disagree; set one"
        )
    return new or old


_WILDCARDS = ("0.0.0.0", "::", "")


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _split_addr(addr: str) -> tuple:
    """``(host, port)`` of ``host:port`` / ``[v6]:port``."""
    host, _, port = addr.rpartition(":")
    return host.strip("[]"), port


def _join_addr(host: str, port: str) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class _RegDList:
    """Registration descriptors: ``(addr, len, dev, meta)`` rows and the
    ``kvlane.Memory`` of each (made at registration for raw addresses)."""

    def __init__(self, rows: List[tuple], mems: List[Optional[kvlane.Memory]],
                 mem_type: Optional[str] = None) -> None:
        self.rows = rows
        self.mems = mems
        self.mem_type = mem_type

    def __len__(self) -> int:
        return len(self.rows)

    def descCount(self) -> int:  # noqa: N802 (NIXL's name)
        return len(self.rows)


class _XferDList:
    """Transfer descriptors: an ``(N, 3)`` uint64 array (addr, len, dev)."""

    def __init__(self, arr: np.ndarray) -> None:
        self.arr = arr

    def __len__(self) -> int:
        return len(self.arr)

    def descCount(self) -> int:  # noqa: N802 (NIXL's name)
        return len(self.arr)


class _Telemetry:
    """NIXL's per-transfer telemetry (microseconds)."""

    def __init__(self, t: kvlane.Telemetry) -> None:
        self.startTime = t.start_time_us
        self.postDuration = t.post_us
        self.xferDuration = t.xfer_us
        self.totalBytes = t.bytes
        self.descCount = t.descriptors

    def __repr__(self) -> str:
        return (
            f"nixlXferTelemetry(postDuration={self.postDuration}, xferDuration={self.xferDuration}, "
            f"totalBytes={self.totalBytes}, descCount={self.descCount})"
        )


class _Xfer:
    def __init__(self, peer: kvlane.Peer, op: str, local: np.ndarray, remote: np.ndarray,
                 notif: Optional[bytes], prepared: kvlane.PreparedTransfer) -> None:
        self.peer = peer
        self.op = op
        self.local = local
        self.remote = remote
        self.notif = notif
        self.prepared = prepared
        self.transfer: Optional[kvlane.Transfer] = None
        self.failed: Optional[BaseException] = None
        self.logged = False  # its failure was logged (check_xfer_state)


def _bytes(msg: Any) -> Optional[bytes]:
    if msg is None:
        return None
    if isinstance(msg, str):
        msg = msg.encode()
    msg = bytes(msg)
    return msg or None


def _name(name: Any) -> str:
    # NIXL hands agent names back as bytes (add_remote_agent) and takes str
    # or bytes; kvlane.nixl does the same.
    return name.decode() if isinstance(name, (bytes, bytearray)) else name


def _check_mem_type(mem_type: Optional[str]) -> None:
    """Raises for memory types kvlane.nixl does not serve."""
    if mem_type not in _HOST_MEM and mem_type not in _GPU_MEM:
        raise kvlane.UnsupportedError(
            f"kvlane.nixl: memory type {mem_type!r} is not supported; host (\"DRAM\") and "
            "GPU (\"VRAM\") memory only"
        )


def _torch_gpu_runtime() -> Optional[str]:
    """``"rocm"`` or ``"cuda"`` per the loaded torch's build; None without
    torch or with a CPU-only build."""
    torch = sys.modules.get("torch")
    version = getattr(torch, "version", None)
    if getattr(version, "hip", None):
        return "rocm"
    if getattr(version, "cuda", None):
        return "cuda"
    return None


def _gpu_runtime() -> str:
    """``"rocm"`` under a ROCm build of torch, else ``"cuda"``."""
    return _torch_gpu_runtime() or "cuda"


def _gpu_memory(addr: int, n: int, dev: int, owner: Any = None) -> kvlane.Memory:
    """GPU memory of NIXL device ``dev``: of the runtime torch was built
    for, else of whichever runtime this machine has (CUDA first, then
    ROCm); with neither, one ``UnsupportedError`` naming both reasons."""
    runtime = _torch_gpu_runtime()
    if runtime is not None:
        return kvlane.Memory.unsafe_from_ptr(addr, n, f"{runtime}:{dev}", owner=owner)
    try:
        return kvlane.Memory.unsafe_from_ptr(addr, n, f"cuda:{dev}", owner=owner)
    except kvlane.UnsupportedError as cuda:
        try:
            return kvlane.Memory.unsafe_from_ptr(addr, n, f"rocm:{dev}", owner=owner)
        except kvlane.UnsupportedError as rocm:
            raise kvlane.UnsupportedError(f"{cuda}; {rocm}") from None


def _rows_of(descs: Any, mem_type: Optional[str]) -> List[tuple]:
    """``(addr, len, dev, obj)`` rows of a descriptor argument; ``obj`` is
    the object whose buffer backs the row (registered zero-copy), or None."""
    if isinstance(descs, np.ndarray) and descs.ndim == 2 and descs.shape[1] in (3, 4):
        _check_mem_type(mem_type)
        return [(int(r[0]), int(r[1]), int(r[2]), None) for r in descs]
    items = descs if isinstance(descs, (list, tuple)) else [descs]
    rows = []
    for d in items:
        if isinstance(d, tuple):
            _check_mem_type(mem_type)
            if len(d) not in (3, 4):
                raise kvlane.InvalidInputError(
                    f"kvlane.nixl: descriptor {d!r} is not (addr, len, dev[, meta])"
                )
            rows.append((int(d[0]), int(d[1]), int(d[2]), None))
        elif hasattr(d, "data_ptr"):  # a torch tensor
            dev = int(d.device.index or 0) if getattr(d, "is_cuda", False) else 0
            rows.append((int(d.data_ptr()), int(d.numel() * d.element_size()), dev, d))
        elif hasattr(d, "__cuda_array_interface__"):  # CuPy, Numba, ...
            cai = d.__cuda_array_interface__
            n = int(np.prod(cai["shape"], dtype=np.int64)) * int(cai["typestr"][2:])
            dev = int(getattr(getattr(d, "device", None), "id", 0) or 0)
            rows.append((int(cai["data"][0]), n, dev, d))
        else:  # any buffer-protocol object
            mv = memoryview(d)
            addr = np.frombuffer(mv.cast("B"), dtype=np.uint8).ctypes.data if mv.nbytes else 0
            rows.append((int(addr), mv.nbytes, 0, d))
    return rows


class nixl_agent:
    """NIXL's ``nixl_agent`` on kvlane (see the module docstring)."""

    def __init__(self, agent_name: str, nixl_conf: Optional[nixl_agent_config] = None,
                 instantiate_all: bool = False) -> None:
        self.name = agent_name
        self._conf = nixl_conf or nixl_agent_config()
        self._agent: Optional[kvlane.Agent] = None
        self._regs: List[kvlane.Memory] = []
        self._deregistered: List[kvlane.Memory] = []
        self._remotes: Dict[str, kvlane.Peer] = {}
        # What each remote's metadata said when it was added: its
        # incarnation and how many registrations it had made after build.
        self._remote_md: Dict[str, tuple] = {}
        # Registrations made after the kvlane agent was built (in metadata).
        self._late_regs = 0
        self._notes: Optional[kvlane.Notifications] = None
        self._dlists: Dict[int, tuple] = {}
        self._xfers: Dict[int, _Xfer] = {}
        self._ids = itertools.count(1)
        self.notifs: Dict[str, List[bytes]] = {}

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        raise NotImplementedError(
            f"kvlane.nixl: nixl_agent.{name} is not implemented (the subset is: {_SUBSET})"
        )

    # -- the kvlane agent ------------------------------------------------

    def _built(self) -> kvlane.Agent:
        if self._agent is None:
            c = self._conf
            if c.psk is None and not _is_loopback(c.listen_host):
                warnings.warn(
                    f"kvlane.nixl: agent {self.name!r} listens on {c.listen_host} without a "
                    "pre-shared key: any process that reaches it can read and write its registered "
                    "memory; set KVLANE_PSK (or nixl_agent_config(psk=...)) on every agent",
                    RuntimeWarning, stacklevel=3,
                )
            self._agent = kvlane.Agent(
                engine_id=self.name,
                listen=_join_addr(c.listen_host, str(c.port)),
                backend=c.backend,
                psk=c.psk,
                advertise=c.advertise_host,
                regions=list(self._regs),
                **c._agent_kwargs(),
            )
            self._notes = self._agent.notifications()
        return self._agent

    def close(self) -> None:
        """Closes the kvlane agent (not a NIXL call; NIXL closes on drop)."""
        if self._agent is not None:
            self._agent.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    # -- registration ----------------------------------------------------

    def _release(self, h: _Handle) -> None:
        table = self._xfers if isinstance(h, nixl_xfer_handle) else self._dlists
        entry = table.pop(h._handle, None)
        if isinstance(entry, _Xfer) and entry.transfer is not None:
            entry.transfer.release()

    def get_reg_descs(self, descs: Any, mem_type: Optional[str] = None) -> _RegDList:
        if isinstance(descs, _RegDList):
            return descs
        rows = _rows_of(descs, mem_type)
        mems: List[Optional[kvlane.Memory]] = []
        for addr, n, dev, obj in rows:
            if obj is not None and not hasattr(obj, "data_ptr"):
                # Buffers, and GPU arrays (the driver names their device).
                mems.append(kvlane.Memory(obj))
            elif obj is not None:
                device = f"{_gpu_runtime()}:{dev}" if getattr(obj, "is_cuda", False) else "cpu"
                mems.append(kvlane.Memory.unsafe_from_ptr(addr, n, device, owner=obj))
            else:
                mems.append(None)
        return _RegDList([r[:3] + ("",) for r in rows], mems, mem_type)

    def register_memory(self, reg_list: Any, mem_type: Optional[str] = None,
                        backends: Sequence[str] = ()) -> _RegDList:
        descs = self.get_reg_descs(reg_list, mem_type)
        for i, (addr, n, _dev, _meta) in enumerate(descs.rows):
            if descs.mems[i] is None:
                # The NIXL contract: registered memory outlives its registration.
                descs.mems[i] = (
                    _gpu_memory(addr, n, int(_dev))
                    if descs.mem_type in _GPU_MEM
                    else kvlane.Memory.unsafe_from_ptr(addr, n, "cpu")
                )
        mems = [m for m in descs.mems if m is not None]
        if self._agent is not None:
            # After the metadata went out: registered now, advertised in
            # the metadata and handshakes from now on (peers add it again).
            for m in mems:
                self._agent.register(m)
                self._regs.append(m)
                self._late_regs += 1
        else:
            self._regs.extend(mems)
        return descs

    def deregister_memory(self, dereg_list: Any, backends: Sequence[str] = ()) -> None:
        # Matched by value (address and length), as NIXL does.
        rows = self.get_reg_descs(dereg_list).rows
        keys = {(r[0], r[1]) for r in rows}
        gone = [m for m in self._regs if (m.addr, m.nbytes) in keys]
        if len(gone) < len(keys):
            raise kvlane.InvalidInputError(
                f"kvlane.nixl: {len(keys) - len(gone)} of the descriptors to deregister "
                "were not registered"
            )
        if self._agent is None:
            self._regs = [m for m in self._regs if all(m is not g for g in gone)]
        else:
            self._deregistered.extend(gone)

    # -- metadata ----------------------------------------------------------

    def get_agent_metadata(self) -> bytes:
        agent = self._built()
        host, port = _split_addr(agent.addr)
        if self._conf.advertise_host:
            host = self._conf.advertise_host
        elif host in _WILDCARDS:
            raise kvlane.InvalidInputError(
                f"kvlane.nixl: agent {self.name!r} listens on the wildcard {agent.addr}, which "
                "peers on other hosts cannot dial from its metadata: set advertise_host "
                "(nixl_agent_config(advertise_host=...) or KVLANE_NIXL_ADVERTISE) to the address "
                "they reach this host at, or listen_host to that address"
            )
        addr = _join_addr(host, port)
        return json.dumps({"kvlane_nixl": 1, "name": self.name, "addr": addr,
                           "incarnation": agent.incarnation, "regs": self._late_regs}).encode()

    def add_remote_agent(self, metadata: bytes) -> bytes:
        try:
            md = json.loads(bytes(metadata))
            name, addr = md["name"], md["addr"]
        except (ValueError, KeyError, TypeError) as e:
            raise kvlane.InvalidInputError(
                f"kvlane.nixl: agent metadata does not decode ({e}); it comes from "
                "kvlane.nixl's get_agent_metadata"
            ) from None
        if _split_addr(str(addr))[0] in _WILDCARDS:
            raise kvlane.InvalidInputError(
                f"kvlane.nixl: the metadata of agent {name!r} names the wildcard address {addr}; "
                "that agent must set advertise_host (or KVLANE_NIXL_ADVERTISE) to an address "
                "this host can reach"
            )
        # Metadata of older kvlane.nixl versions has neither field.
        md_key = (md.get("incarnation"), md.get("regs", 0))
        old = self._remotes.get(name)
        if old is not None and old.addr == str(addr):
            if self._remote_md.get(name) == md_key or md_key[0] is None:
                return name.encode()
            # The same agent with newer metadata (memory registered since,
            # or a restart): connect again, so the handshake advertises
            # what it has now. Handles made before end in ERR.
            del self._remotes[name]
            self._remote_md.pop(name, None)
            self._disconnect(old)
            old = None
        peer = self._built().connect(addr)
        if peer.engine_id != name:
            raise kvlane.RefusedError(
                f"kvlane.nixl: {addr} is agent {peer.engine_id!r}, the metadata says {name!r}"
            )
        if old is not None:
            # The agent is back at another address (restarted on a new
            # port): the new connection replaces the old one. Handles made
            # before keep the old peer and end in ERR.
            self._disconnect(old)
        # The incarnation the metadata describes (the one connected to,
        # unless the agent restarted in between): check_remote_metadata is
        # False once the peer is no longer that incarnation. Written before
        # the peer, so whoever sees the new peer sees its metadata.
        self._remote_md[name] = (md_key[0] if md_key[0] is not None else peer.incarnation,
                                 md_key[1])
        self._remotes[name] = peer
        return name.encode()

    @staticmethod
    def _disconnect(peer: kvlane.Peer) -> None:
        try:
            peer.disconnect()
        except kvlane.Error:
            pass

    def remove_remote_agent(self, agent: str) -> None:
        agent = _name(agent)
        peer = self._remotes.pop(agent, None)
        self._remote_md.pop(agent, None)
        if peer is None:
            raise kvlane.InvalidInputError(f"kvlane.nixl: no remote agent {agent!r} was added")
        peer.disconnect()

    def check_remote_metadata(self, remote_name: Any, descs: Any = None) -> bool:
        """Whether the metadata of agent ``remote_name`` is loaded and still
        describes it, and (with ``descs``, any form ``get_xfer_descs``
        takes) whether every descriptor lies in memory it advertised.
        False for an agent never added or removed, and once the agent is
        dead (keep-alive gave up) or restarted: its metadata then no
        longer describes a live process, which is what makes vLLM drop
        the engine and handshake again. Never raises for an unknown name;
        never blocks."""
        name = _name(remote_name)
        peer = self._remotes.get(name)
        if peer is None:
            return False
        incarnation = self._remote_md.get(name, (None,))[0]
        if not peer.attached or peer.incarnation != incarnation:
            return False
        if descs is None:
            return True
        arr = self.get_xfer_descs(descs).arr
        for op in ("READ", "WRITE"):
            try:
                peer.check_remote_spans(op, arr)
                return True
            except kvlane.InvalidInputError:
                pass
        return False

    # -- descriptor lists ------------------------------------------------

    def get_xfer_descs(self, descs: Any, mem_type: Optional[str] = None) -> _XferDList:
        if isinstance(descs, _XferDList):
            return descs
        if isinstance(descs, np.ndarray) and descs.ndim == 2 and descs.shape[1] == 3:
            _check_mem_type(mem_type)
            if descs.dtype in (np.uint64, np.int64) and descs.flags.c_contiguous:
                return _XferDList(descs.view(np.uint64))  # zero-copy
            return _XferDList(np.ascontiguousarray(descs, dtype=np.uint64))
        rows = _rows_of(descs, mem_type)
        arr = np.array([r[:3] for r in rows], dtype=np.uint64).reshape(-1, 3)
        return _XferDList(arr)

    def _peer(self, agent_name: str) -> kvlane.Peer:
        agent_name = _name(agent_name)
        peer = self._remotes.get(agent_name)
        if peer is None:
            raise kvlane.InvalidInputError(
                f"kvlane.nixl: no remote agent {agent_name!r}; add_remote_agent it first"
            )
        return peer

    def _check_local(self, arr: np.ndarray) -> None:
        for m in self._deregistered:
            lo, hi = m.addr, m.addr + m.nbytes
            if len(arr) and bool(np.any((arr[:, 0] < hi) & (arr[:, 0] + arr[:, 1] > lo))):
                raise kvlane.InvalidInputError(
                    f"kvlane.nixl: a descriptor lies in deregistered memory {m!r}"
                )
        self._built().check_spans("WRITE", arr)

    def prep_xfer_dlist(self, agent_name: str, xfer_list: Any, mem_type: Optional[str] = None,
                        backends: Sequence[str] = ()) -> nixl_prepped_dlist_handle:
        arr = self.get_xfer_descs(xfer_list, mem_type).arr
        agent_name = _name(agent_name)
        if agent_name in (_LOCAL, "", self.name):
            self._check_local(arr)
            side = None
        else:
            self._peer(agent_name).check_remote_spans("READ", arr)
            side = agent_name
        h = next(self._ids)
        self._dlists[h] = (side, arr)
        return nixl_prepped_dlist_handle(self, h)

    def release_dlist_handle(self, handle: nixl_prepped_dlist_handle) -> None:
        handle.release()

    def _entry(self, table: dict, handle: Any, kind: type) -> Any:
        if not isinstance(handle, kind) or handle._agent is not self:
            raise kvlane.InvalidInputError(
                f"kvlane.nixl: {handle!r} is not a {kind._what} of agent {self.name!r}"
            )
        entry = table.get(handle._handle)
        if entry is None:
            raise kvlane.InvalidInputError(f"kvlane.nixl: {kind._what} {handle!r} was released")
        return entry

    def _dlist(self, handle: nixl_prepped_dlist_handle) -> tuple:
        return self._entry(self._dlists, handle, nixl_prepped_dlist_handle)

    # -- transfers ---------------------------------------------------------

    def _make(self, operation: str, local: np.ndarray, remote: np.ndarray, agent_name: str,
              notif_msg: Any) -> int:
        if operation not in ("READ", "WRITE"):
            raise kvlane.InvalidInputError(f"kvlane.nixl: operation is \"READ\" or \"WRITE\", not {operation!r}")
        peer = self._peer(agent_name)
        notif = _bytes(notif_msg)
        prepared = peer.prepare_spans(operation, local, remote, notif)
        h = next(self._ids)
        self._xfers[h] = _Xfer(peer, operation, local, remote, notif, prepared)
        return nixl_xfer_handle(self, h)

    def make_prepped_xfer(self, operation: str, local_xfer_side: nixl_prepped_dlist_handle,
                          local_indices: Any, remote_xfer_side: nixl_prepped_dlist_handle,
                          remote_indices: Any, notif_msg: Any = b"", backends: Sequence[str] = (),
                          skip_desc_merge: bool = False) -> nixl_xfer_handle:
        lside, larr = self._dlist(local_xfer_side)
        rside, rarr = self._dlist(remote_xfer_side)
        if lside is not None:
            raise kvlane.InvalidInputError("kvlane.nixl: the local side must be a NIXL_INIT_AGENT dlist")
        if rside is None:
            raise kvlane.InvalidInputError("kvlane.nixl: the remote side must be a remote agent's dlist")
        li = np.asarray(local_indices, dtype=np.int64).reshape(-1)
        ri = np.asarray(remote_indices, dtype=np.int64).reshape(-1)
        for what, idx, arr in (("local", li, larr), ("remote", ri, rarr)):
            if len(idx) and (idx.min() < 0 or idx.max() >= len(arr)):
                raise kvlane.InvalidInputError(
                    f"kvlane.nixl: {what} index out of range 0..{len(arr)} of its dlist"
                )
        if len(li) != len(ri):
            raise kvlane.InvalidInputError(
                f"kvlane.nixl: {len(li)} local indices but {len(ri)} remote indices"
            )
        return self._make(operation, larr[li], rarr[ri], rside, notif_msg)

    def initialize_xfer(self, operation: str, local_descs: Any, remote_descs: Any,
                        remote_agent: str, notif_msg: Any = b"",
                        backends: Sequence[str] = ()) -> nixl_xfer_handle:
        larr = self.get_xfer_descs(local_descs).arr
        rarr = self.get_xfer_descs(remote_descs).arr
        self._check_local(larr)
        return self._make(operation, larr, rarr, remote_agent, notif_msg)

    def _xfer(self, handle: nixl_xfer_handle) -> _Xfer:
        # The per-transfer calls' fast path; _entry says what is wrong.
        if type(handle) is nixl_xfer_handle and handle._agent is self:
            x = self._xfers.get(handle._handle)
            if x is not None:
                return x
        return self._entry(self._xfers, handle, nixl_xfer_handle)

    def transfer(self, handle: nixl_xfer_handle, notif_msg: Any = b"") -> str:
        x = self._xfer(handle)
        if x.transfer is not None and not x.transfer.done():
            raise kvlane.BusyError(f"kvlane.nixl: transfer handle {handle!r} is still in progress")
        notif = _bytes(notif_msg) if notif_msg else None
        # Until the post below succeeds the handle holds no result: a post
        # that raises leaves it "not posted", never the last post's DONE.
        x.transfer, x.failed = None, None
        try:
            if notif is not None and notif != x.notif:
                # The new message is kept only with the plan that carries it.
                x.prepared = x.peer.prepare_spans(x.op, x.local, x.remote, notif)
                x.notif = notif
            # Reposting reuses the plan, or plans the spans again once the
            # peer restarted (PreparedTransfer).
            x.transfer = x.peer.post(x.prepared)
        except (kvlane.PeerLostError, kvlane.ClosedError, kvlane.TimeoutError, kvlane.IoError) as e:
            x.failed = e
            x.logged = True
            _log.warning("kvlane.nixl: transfer %r (%s) was refused: %s", handle, x.op, e)
            return "ERR"
        return "DONE" if x.transfer.status == "done" else "PROC"

    def check_xfer_state(self, handle: nixl_xfer_handle) -> str:
        x = self._xfer(handle)
        if x.failed is not None:
            return "ERR"
        t = x.transfer
        if t is None:
            raise kvlane.InvalidInputError(f"kvlane.nixl: transfer handle {handle!r} was not posted")
        # Never blocks and keeps the GIL ("PROC" gives the core away once:
        # engines poll this in a loop).
        state = t._poll_state()
        if state == "ERR" and not x.logged:
            # NIXL's state says only "ERR"; the engine logs that much. Say
            # why, once per transfer (peer, error kind, what timed out).
            x.logged = True
            _log.warning("kvlane.nixl: transfer %r (%s) failed: %s", handle, x.op, t.error())
        return state

    def get_xfer_telemetry(self, handle: nixl_xfer_handle) -> _Telemetry:
        x = self._xfer(handle)
        if x.transfer is None:
            raise kvlane.InvalidInputError(f"kvlane.nixl: transfer handle {handle!r} was not posted")
        return _Telemetry(x.transfer.telemetry)

    def release_xfer_handle(self, handle: nixl_xfer_handle) -> None:
        handle.release()

    # -- notifications ---------------------------------------------------

    def get_new_notifs(self, backends: Sequence[str] = ()) -> Dict[str, List[bytes]]:
        out: Dict[str, List[bytes]] = {}
        if self._notes is None:
            return out
        for n in self._notes.drain():
            out.setdefault(n.sender, []).append(n.payload)
        return out

    def update_notifs(self, backends: Sequence[str] = ()) -> Dict[str, List[bytes]]:
        for k, v in self.get_new_notifs().items():
            self.notifs.setdefault(k, []).extend(v)
        return self.notifs

    def check_remote_xfer_done(self, remote_agent_name: str, lookup_tag: bytes,
                               backends: Sequence[str] = (), tag_is_prefix: bool = True) -> bool:
        self.update_notifs()
        remote_agent_name = _name(remote_agent_name)
        for msg in self.notifs.get(remote_agent_name, []):
            if (msg.startswith(lookup_tag) if tag_is_prefix else lookup_tag in msg):
                self.notifs[remote_agent_name].remove(msg)
                return True
        return False

    def send_notif(self, remote_agent_name: str, notif_msg: Any) -> None:
        self._peer(remote_agent_name).notify(_bytes(notif_msg) or b"")
