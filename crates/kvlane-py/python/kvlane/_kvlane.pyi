"""Type stubs of kvlane's native module (re-exported by ``kvlane``)."""

from typing import Any, Awaitable, Dict, Generator, Iterable, List, Optional, Sequence, Tuple, Union

__version__: str

# A descriptor list: (addr, len[, dev[, meta]]) tuples, or an (N, 2) / (N, 3)
# array of 8-byte integers read in place.
Spans = Union[Sequence[Tuple[int, ...]], Any]

class Error(Exception):
    """Base class of every kvlane error."""

class TimeoutError(Error):
    """A deadline passed (transfer, handshake)."""

class PeerLostError(Error):
    """The peer died, restarted or was disconnected."""

class StaleError(PeerLostError):
    """The transfer was prepared against an older incarnation of the peer."""

class RefusedError(Error):
    """The peer or target refused (keys, bounds, rights, handshake, peer cap)."""

class BusyError(Error):
    """The submission queue is full; retry after earlier transfers completed."""

class InvalidInputError(Error):
    """The request is invalid (layout, ids, spans, lengths, a released handle)."""

class UnsupportedError(Error):
    """The backend or device cannot do this here."""

class ClosedError(Error):
    """The agent is closed."""

class IoError(Error):
    """Network or OS failure."""

class _SharedAlloc:
    """Owner of the shareable memory behind a ``kvlane.host_buffer`` array
    (use ``kvlane.host_buffer``)."""

    def __init__(self, nbytes: int) -> None: ...
    @property
    def addr(self) -> int: ...
    @property
    def nbytes(self) -> int: ...

class Memory:
    """Registered memory: a buffer-protocol object, held zero-copy, or a GPU
    array (torch CUDA tensor, CuPy array: ``__cuda_array_interface__``)."""

    def __init__(self, obj: Any, *, readonly: Optional[bool] = None) -> None: ...
    @staticmethod
    def unsafe_from_ptr(
        ptr: int, nbytes: int, device: str = "cpu", *, readonly: bool = False, owner: Any = None
    ) -> "Memory":
        """Foreign memory by address, on ``device`` ``"cpu"`` or a GPU
        (``"cuda:0"``, ``"rocm:0"``); the caller guarantees it outlives the
        registration, every agent using it and every transfer."""
    @property
    def addr(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def readonly(self) -> bool: ...
    @property
    def device(self) -> str:
        """``"cpu"`` or the GPU, e.g. ``"cuda:0"``."""
    def __len__(self) -> int: ...

class KvLayout:
    """KV-cache geometry."""

    def __init__(
        self, layers: int, blocks: int, block_bytes: int, parts: str = "separate",
        order: str = "layer_major",
    ) -> None: ...
    @property
    def required_len(self) -> int: ...
    @property
    def layers(self) -> int: ...
    @property
    def blocks(self) -> int: ...
    @property
    def block_bytes(self) -> int: ...
    def offset(self, layer: int, part: int, block: int) -> int: ...

class Telemetry:
    """What one transfer cost (microseconds)."""

    start_time_us: int
    post_us: int
    xfer_us: int
    bytes: int
    descriptors: int

class Transfer:
    """A posted transfer."""

    def wait(self, timeout: Optional[float] = None) -> bool:
        """True when it finished, False if still running after ``timeout``
        seconds; raises its error if it failed. Ctrl-C interrupts it."""
    def _poll_state(self) -> str:
        """NIXL's state word ("DONE", "ERR", "PROC"); while running it
        yields the CPU once with the GIL released (for polling loops)."""
    def done(self) -> bool: ...
    @property
    def status(self) -> str:
        """``"pending"``, ``"done"`` or ``"failed"``."""
    def error(self) -> Optional[Error]: ...
    @property
    def telemetry(self) -> Telemetry: ...
    def add_done_callback(self, callback: Any) -> None: ...
    def release(self) -> None: ...
    def __await__(self) -> Generator[Any, None, None]: ...

class PreparedTransfer:
    """A planned transfer; post it with ``Peer.post`` as often as needed.

    Every post reuses the plan (a new transfer each time, with the bytes
    the buffers hold then) while the peer keeps the incarnation it was
    planned against; after the peer restarted, a post plans the same spans
    again against the new incarnation (checks included) and keeps that
    plan, so a restarted peer is never written through its old keys."""

    @property
    def descriptors(self) -> int: ...
    @property
    def bytes(self) -> int: ...

class Notification:
    sender: str
    payload: bytes

class Notifications:
    def recv(self, timeout: Optional[float] = None) -> Optional[Notification]: ...
    def try_recv(self) -> Optional[Notification]: ...
    def drain(self) -> List[Notification]: ...
    @property
    def closed(self) -> bool: ...
    def __iter__(self) -> "Notifications": ...
    def __next__(self) -> Notification: ...
    def __aiter__(self) -> "Notifications": ...
    def __anext__(self) -> Awaitable[Notification]: ...

class PeerEvent:
    peer: int
    addr: str
    kind: str
    detail: str

class PeerEvents:
    def recv(self, timeout: Optional[float] = None) -> Optional[PeerEvent]: ...
    @property
    def closed(self) -> bool: ...
    def __iter__(self) -> "PeerEvents": ...
    def __next__(self) -> PeerEvent: ...
    def __aiter__(self) -> "PeerEvents": ...
    def __anext__(self) -> Awaitable[PeerEvent]: ...

class Peer:
    """A connected remote agent."""

    @property
    def engine_id(self) -> str: ...
    @property
    def addr(self) -> str: ...
    @property
    def incarnation(self) -> Optional[int]: ...
    @property
    def attached(self) -> bool:
        """Whether the connection is up with its data plane attached:
        false while the peer is dead, after it restarted until its new
        incarnation is attached, and once disconnected."""
        ...
    @property
    def backend(self) -> Optional[str]:
        """The backend that carries this side's transfers to the peer
        while attached: with ``backend="auto"``, ``"shm"`` for a peer on
        this host that shared memory reached, else ``"tcp"`` or
        ``"verbs"`` (why not shm is logged at ``info``:
        ``KVLANE_LOG=info``); ``None`` while not attached."""
        ...
    def remote_regions(self) -> List[Dict[str, Any]]: ...
    def write_blocks(
        self, layers: Tuple[int, int], local_ids: Sequence[int], remote_ids: Sequence[int],
        notify: Optional[bytes] = None,
    ) -> Transfer: ...
    def read_blocks(
        self, layers: Tuple[int, int], local_ids: Sequence[int], remote_ids: Sequence[int],
        notify: Optional[bytes] = None,
    ) -> Transfer: ...
    def prepare_spans(
        self, op: str, local: Spans, remote: Spans, notify: Optional[bytes] = None
    ) -> PreparedTransfer: ...
    def check_remote_spans(self, op: str, spans_: Spans) -> None: ...
    def post(self, prepared: PreparedTransfer) -> Transfer: ...
    def post_batch(self, prepared: Iterable[PreparedTransfer]) -> List[Transfer]:
        """Posts every item in one call (one hand-over to the backend);
        one ``Transfer`` per item, in order. A transfer the peer refused
        comes back already failed (its ``wait()`` raises), never as an
        exception from this call, so no posted transfer loses its handle.
        Raises ``InvalidInputError`` naming an item that is not a
        ``PreparedTransfer`` (before posting any) and ``ClosedError`` on a
        closed agent."""
        ...
    def write_spans(self, local: Spans, remote: Spans, notify: Optional[bytes] = None) -> Transfer: ...
    def read_spans(self, local: Spans, remote: Spans, notify: Optional[bytes] = None) -> Transfer: ...
    def notify(self, payload: bytes) -> None: ...
    def ping(self) -> float: ...
    def disconnect(self) -> None: ...

class Agent:
    """An engine's kvlane endpoint."""

    def __init__(
        self,
        engine_id: Optional[str] = None,
        listen: str = "127.0.0.1:0",
        backend: str = "auto",
        psk: Optional[bytes] = None,
        advertise: Optional[str] = None,
        kv: Optional[Sequence[Tuple[KvLayout, Any]]] = None,
        regions: Optional[Sequence[Any]] = None,
        keepalive_interval: Optional[float] = None,
        liveness_budget: Optional[int] = None,
        transfer_deadline: Optional[float] = None,
        handshake_timeout: Optional[float] = None,
        cpus: Optional[str] = None,
        shm_cross_memory_attach: bool = False,
    ) -> None:
        """``backend``: ``"auto"`` (the default: shared memory to each peer
        on this host, same kernel and network namespace, when both sides
        serve memory shm can serve, and otherwise verbs when built with it
        and a device is usable, else tcp; why not shm is logged at
        ``info``; ``Peer.backend`` says what a peer got;
        ``KVLANE_SAME_HOST_SHM=0`` turns shm off), ``"tcp"``, ``"verbs"``,
        ``"loopback"`` (one process), ``"shm"`` (shared memory, peers on
        this host only) or ``"same-host"`` (the same as ``"auto"``, but
        shm even with ``KVLANE_SAME_HOST_SHM=0``). Anything else raises
        ``InvalidInputError``. Memory shm serves: ``kvlane.host_buffer``
        arrays registered whole (shareable memory files); numpy arrays,
        torch CPU tensors and other memory Python allocated only with
        ``shm_cross_memory_attach=True``: registering one without it
        turns shm off for this agent (its peers use tcp or verbs).
        GPU memory (torch CUDA tensors, CuPy arrays) is served over shm by
        CUDA/HIP IPC handle, which hands a peer's driver the whole
        allocation holding the buffer (for a tensor of PyTorch's caching
        allocator, its whole segment); so far tested only against a mock
        driver, not on a GPU.

        ``shm_cross_memory_attach``: with ``"auto"``, ``"shm"`` or
        ``"same-host"``, serve the registered buffers that are not
        shareable memory files (numpy arrays, tensors,
        ``kvlane.host_buffer(n, shared=False)``: memory Python allocated)
        to peers on this host by cross-memory attach
        (``process_vm_readv``/``process_vm_writev``): one copy, by the
        peer. Default False: ``"shm"`` then refuses them
        (``UnsupportedError``) and ``"auto"`` serves every peer over tcp
        or verbs. **It exposes this whole process**, not only the registered
        buffers, to every process the kernel lets attach to it (the same
        user while the process is dumpable, or root): kvlane keeps a
        well-behaved peer inside the registered buffers and their rights,
        nothing holds a hostile one. Such processes could already ptrace
        this one; the opt-in hands them the addresses. A peer of another
        user is refused by the kernel (``EPERM``): with ``"auto"`` it
        falls back to tcp or verbs.

        ``transfer_deadline``: seconds after its post a transfer may run
        before it fails with ``TimeoutError`` (default 30).
        ``keepalive_interval`` (seconds between pings), ``liveness_budget``
        (missed pings before a peer is dead) and ``handshake_timeout``
        (seconds) tune the control plane.

        ``cpus``: where the threads kvlane starts run: ``"inherit"`` (the
        default: the mask of the thread that builds the agent, e.g. the
        core an engine pinned its worker to), ``"all"`` (every CPU the
        process may use, even when this thread was narrowed) or a CPU list
        such as ``"0-3,8"``. Without it, the ``KVLANE_CPUS`` environment
        variable decides. Threads are shared by the agents of a process:
        the first agent's placement holds for them. A value that does not
        parse, or names no CPU this process may use, raises
        ``InvalidInputError`` naming it."""
        ...
    @property
    def engine_id(self) -> str: ...
    @property
    def addr(self) -> str: ...
    @property
    def backend(self) -> str: ...
    @property
    def incarnation(self) -> int: ...
    @property
    def closed(self) -> bool: ...
    def connect(self, addr: str) -> Peer: ...
    def register(self, memory: Any) -> None:
        """Registers ``memory`` (a buffer or ``Memory``) after the agent
        was built: usable locally once this returns and advertised in every
        later handshake; peers connected before learn it by connecting
        again."""
        ...
    def check_spans(self, op: str, spans_: Spans) -> None: ...
    def notifications(self) -> Notifications: ...
    def events(self) -> PeerEvents: ...
    def close(self) -> None: ...
    def __enter__(self) -> "Agent": ...
    def __exit__(self, *args: Any) -> bool: ...
