"""vLLM prefill/decode (P/D) over a KV connector, checked end to end: the
engine test behind ci/vllm.sh, and the in-engine measurements.

    python pd.py check --connector kvlane [--repeats N] [--cases ...] [--kvlane-backend same-host]
    python pd.py bench [--connectors none,null,nixl,nixl-placed,kvlane] [--lengths 100,1000,4000]

Every engine is a real vLLM (CPU build) in processes of its own
(ci/vllm/engine.py: the offline `vllm.LLM`, its engine core and worker),
driven over a pipe. Prefill and decode run on cores of their own
(`--placement split`, the default; see `placement()` for why).

The proof that the KV cache came over the wire: prefill gets each prompt
with every token but the last changed, decode gets the original prompt plus
prefill's `kv_transfer_params`. Decode computes only the last prompt token
itself, so its tokens must equal a single instance's tokens for the
*changed* prompt; had it recomputed (or read garbage), they would not. The
script checks first that, for every prompt, the changed and the original
prompt give different tokens, so the check can fail. (Changing only the
first token, as ../shared/ENGINES.md suggests, is not enough past ~100
tokens with this model: one token in 128 no longer moves the argmax.)

`check` cases:
- `pd`: prompts of 5..1000 tokens, batched, and one by one with prefill
  working on the next while decode loads (both engines busy), `--repeats`
  times;
- `kill-decode`: decode killed while loading; prefill keeps serving, frees
  the orphaned blocks when their lease ends (its log says so), and a new
  decode works;
- `kill-prefill`: prefill killed; decode fails the requests whose KV was on
  it (finish_reason "error") within the liveness budget, and keeps serving;
- `stop-prefill`: prefill frozen (SIGSTOP: sockets open, nothing answers);
  decode fails its loads within the liveness budget (keep-alive), and
  works with it again once it resumes;
- `restart-prefill`: prefill restarted with the same engine id and side
  channel port; decode reaches the new one, and no request is answered from
  the old one's blocks (each is correct or failed, then correct again).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
VOCAB = 1024
# Prompt lengths for the correctness check: one block (128 tokens) and its
# edges, several blocks, ~1,000 tokens (8 blocks of 128 KiB per layer).
CHECK_LENGTHS = [5, 127, 128, 129, 300, 700, 1000]
# Prefill's KV lease: vLLM's default (it was 10 s for a quicker kill-decode
# case). A decode that reaches a request after the lease released its
# blocks reads whatever the next prompt wrote there: wrong tokens. That was
# seen with both engines on every core, where a prefill holding blocks
# starves the decode until the lease ends (see placement(); issue 40).
LEASE_S = 30


def log(*a: Any) -> None:
    print(f"[pd {time.strftime('%H:%M:%S')}]", *a, file=sys.stderr, flush=True)


class Failed(Exception):
    pass


class PipeEngine:
    """One engine process group driven over a pipe (a JSON line per request
    and per answer, the first answer `{"ready": ...}`), with its stderr kept
    in a log file."""

    def __init__(self, name: str, args: List[str], logdir: str,
                 extra_env: Optional[Dict[str, str]] = None) -> None:
        self.name = name
        self.log_path = os.path.join(logdir, f"{name}.log")
        env = dict(os.environ)
        env.update(extra_env or {})
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._log, env=env, start_new_session=True)
        self._lines: "queue.Queue[Optional[dict]]" = queue.Queue()
        self._ids = iter(range(1, 1 << 30))
        threading.Thread(target=self._read, daemon=True).start()
        self._ready: Optional[dict] = None

    def ready(self, timeout: float = 300) -> "PipeEngine":
        """Waits for the engine to be built (engines start in parallel)."""
        if self._ready is None:
            first = self._next(timeout=timeout)
            if not first.get("ready"):
                raise Failed(f"{self.name}: unexpected first line {first}")
            log(f"{self.name}: ready in {first['secs']} s (pid {first['pid']})")
            self._ready = first
        return self

    @property
    def ready_line(self) -> dict:
        """The engine's first line, `{"ready": true, ...}`."""
        self.ready()
        assert self._ready is not None
        return self._ready

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                self._lines.put(json.loads(line))
            except ValueError:
                pass
        self._lines.put(None)

    def _next(self, timeout: float) -> dict:
        try:
            msg = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise Failed(f"{self.name}: no answer in {timeout} s (log: {self.log_path})")
        if msg is None:
            raise Failed(f"{self.name}: exited with {self.proc.wait()} (log: {self.log_path})")
        return msg

    def request(self, req: Dict[str, Any]) -> int:
        """Sends `req` with a new id; returns the id."""
        self.ready()
        rid = next(self._ids)
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps({"id": rid, **req}) + "\n").encode())
        self.proc.stdin.flush()
        return rid

    def answer(self, rid: int, timeout: float = 300) -> dict:
        msg = self._next(timeout)
        if msg.get("id") != rid:
            raise Failed(f"{self.name}: answer {msg.get('id')} for request {rid}")
        return msg

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()
        self._log.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass
        self.kill()

    def pids(self) -> List[int]:
        """The engine's processes (its session: engine.py, vLLM's engine
        core and worker)."""
        sid = os.getsid(self.proc.pid)
        out = []
        for pid in os.listdir("/proc"):
            try:
                if pid.isdigit() and os.getsid(int(pid)) == sid:
                    out.append(int(pid))
            except OSError:
                continue
        return out

    def threads(self) -> List[Tuple[int, int, str, List[str]]]:
        """Every thread of the engine's processes: `(pid, tid, name, the
        fields of /proc/PID/task/TID/stat after the name)`, so `fields[0]` is
        the state, `fields[11] + fields[12]` the CPU ticks, `fields[36]` the
        CPU it last ran on."""
        out = []
        for pid in self.pids():
            try:
                for tid in os.listdir(f"/proc/{pid}/task"):
                    with open(f"/proc/{pid}/task/{tid}/stat") as f:
                        st = f.read()
                    name = st[st.index("(") + 1:st.rindex(")")]
                    out.append((pid, int(tid), name, st[st.rindex(")") + 1:].split()))
            except OSError:
                continue
        return out

    def log_text(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()


class Engine(PipeEngine):
    """One engine.py process group (ci/vllm/engine.py's protocol)."""

    def __init__(self, name: str, role: str, model: str, connector: str, logdir: str,
                 side_port: int = 0, extra_env: Optional[Dict[str, str]] = None) -> None:
        self.role = role
        args = [sys.executable, os.path.join(HERE, "engine.py"), "--role", role,
                "--model", model, "--connector", connector]
        if side_port:
            args += ["--side-port", str(side_port)]
        super().__init__(name, args, logdir, extra_env)

    def send(self, prompts: List[List[int]], kv: Optional[List[Any]] = None,
             max_tokens: int = 8) -> int:
        return self.request({"prompts": prompts, "kv": kv, "max_tokens": max_tokens})

    def run(self, prompts: List[List[int]], kv: Optional[List[Any]] = None,
            max_tokens: int = 8, timeout: float = 300) -> dict:
        return self.answer(self.send(prompts, kv, max_tokens), timeout)

    def worker_cpus(self) -> List[int]:
        """The CPUs the engine's worker thread (the one that drives the
        model) may run on, read from /proc."""
        for pid in self.pids():
            try:
                with open(f"/proc/{pid}/comm") as f:
                    if f.read().strip() == "VLLM::Worker":
                        return sorted(os.sched_getaffinity(pid))
            except OSError:
                continue
        raise Failed(f"{self.name}: no VLLM::Worker process found")

    def stop_all(self) -> float:
        """SIGSTOPs the engine's processes and waits until every thread of
        them is stopped (a signal is sent at once but takes effect as each
        thread next runs; a transfer must not slip through meanwhile)."""
        t = time.monotonic()
        os.killpg(self.proc.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while True:
            running = [f"{pid}/{tid}:{fields[0]}" for pid, tid, _, fields in self.threads()
                       if fields[0] not in ("T", "t", "Z", "X")]
            if not running:
                return time.monotonic() - t
            if time.monotonic() > deadline:
                raise Failed(f"{self.name}: threads still running 10 s after SIGSTOP: {running}")
            time.sleep(0.01)


def placement(how: str, role: str) -> Dict[str, str]:
    """Where an engine's threads run. `split` (the default): prefill on the
    first half of the CPUs, decode on the second (one core each on 2), set
    with vLLM's own `VLLM_CPU_OMP_THREADS_BIND`, as vLLM's CPU docs run
    several instances on one host. `shared`: vLLM's default for each, every
    engine on every core.

    Why split: while a prefill holds blocks for a remote decode, its engine
    steps without pause (vLLM 0.32: `has_requests()` keeps the busy loop
    going until the decode's notification or the lease), and with shared
    cores that loop starves the decode engine. Measured here (/tmp/hold.py,
    2 vCPUs, shared): with the real NIXL a decode call waited 29.6 s, until
    the prefill's 30 s lease ended; with kvlane 3.7-4.1 s per call for the
    lease's length. A decode starved past the lease reads blocks prefill
    already gave to the next prompt: wrong tokens, with NIXL as with kvlane
    (vLLM's pull protocol has no guard for it)."""
    if how == "shared" or role not in ("prefill", "decode"):
        return {}
    cpus = sorted(os.sched_getaffinity(0))
    half = max(1, len(cpus) // 2)
    mine = cpus[:half] if role == "prefill" else cpus[half:] or cpus[-1:]
    return {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, mine))}


def make_prompts(lengths: List[int], seed: int) -> List[List[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in lengths]


def changed(p: List[int]) -> List[int]:
    """The prompt with every token but the last changed: decode computes
    only the last token itself, so all the rest must come from prefill's KV."""
    return [3 + (t + 500) % (VOCAB - 3) for t in p[:-1]] + p[-1:]


class Setup:
    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.dir = a.workdir or tempfile.mkdtemp(prefix="kvlane-vllm-")
        self.model = os.path.join(self.dir, "model")
        if not os.path.exists(os.path.join(self.model, "model.safetensors")):
            subprocess.run([sys.executable, os.path.join(HERE, "make_model.py"), self.model],
                           check=True)
        self.logdir = os.path.join(self.dir, "logs")
        os.makedirs(self.logdir, exist_ok=True)
        self.port = a.side_port
        self.n = 0

    def engine(self, role: str, connector: str, env: Optional[Dict[str, str]] = None,
               name: Optional[str] = None, side_port: int = 0,
               cores_of: Optional[str] = None) -> Engine:
        """An engine; with `--placement split`, prefill and decode (and
        `cores_of`'s role for another) run on cores of their own."""
        self.n += 1
        env = {**placement(self.a.placement, cores_of or role), **(env or {})}
        return Engine(name or f"{self.n:02d}-{role}-{connector}", role, self.model,
                      connector, self.logdir, side_port, env)

    def connector_env(self, connector: str) -> Dict[str, str]:
        env = {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1"}
        if connector in ("nixl", "nixl-placed"):
            # vLLM imports `nixl._api`; the wheel is `nixl_cu12` (see ENGINES.md).
            shim = os.path.join(self.dir, "nixl-shim")
            os.makedirs(os.path.join(shim, "nixl"), exist_ok=True)
            with open(os.path.join(shim, "nixl", "__init__.py"), "w") as f:
                f.write("")
            with open(os.path.join(shim, "nixl", "_api.py"), "w") as f:
                f.write("from nixl_cu12._api import *  # noqa: F401,F403\n"
                        "from nixl_cu12._api import nixl_agent, nixl_agent_config  # noqa\n")
            # HERE: nixl_placed.py, for `nixl-placed`.
            env["PYTHONPATH"] = os.pathsep.join([shim, HERE, os.environ.get("PYTHONPATH", "")])
            env["UCX_TLS"] = "tcp"
        if connector == "kvlane" and getattr(self.a, "kvlane_backend", None):
            env["KVLANE_BACKEND"] = self.a.kvlane_backend
            if self.a.kvlane_backend in ("same-host", "shm"):
                # vLLM's KV cache is torch memory: over shm only by
                # cross-memory attach (see README, "Same host").
                env["KVLANE_SHM_CROSS_MEMORY_ATTACH"] = "1"
                # samehost logs the backend each peer got (checked below).
                env["KVLANE_LOG"] = "kvlane_data::samehost=info"
        if connector == "kvlane" and self.auto():
            # auto leaves shm for vLLM's torch KV cache and says why
            # (checked below).
            env["KVLANE_LOG"] = "kvlane::backend=info,kvlane_data::samehost=info"
        return env

    def auto(self) -> bool:
        """The kvlane engines run `auto`: named, or by default."""
        b = getattr(self.a, "kvlane_backend", None) or os.environ.get("KVLANE_BACKEND", "auto")
        return b == "auto"

    def kvlane_log_lines(self):
        """(engine log name, line) of every kvlane engine's log."""
        for name in sorted(os.listdir(self.logdir)):
            if "kvlane" not in name:
                continue
            with open(os.path.join(self.logdir, name), errors="replace") as f:
                for line in f:
                    yield name, line

    def check_backend(self) -> None:
        """With `--kvlane-backend same-host`, every peer of every kvlane
        engine went over shm: the engines log the choice per peer, and a
        run that fell back to tcp must not pass as an shm run. With `auto`
        (the default), vLLM's KV cache is torch memory, which shm serves
        only with cross-memory attach: every kvlane engine must have said
        so and no peer may have gone over shm."""
        auto = self.a.connector == "kvlane" and self.auto()
        if not auto and getattr(self.a, "kvlane_backend", None) != "same-host":
            return
        via_shm, other, said = [], [], set()
        for name, line in self.kvlane_log_lines():
            if "shm: peer via shm" in line:
                via_shm.append(f"{name}: {line.strip()}")
            elif "shm: peer via" in line or "shm: falling back" in line:
                other.append(f"{name}: {line.strip()}")
            elif ("no shm to peers on this host" in line
                  or "shm: off for peers" in line) and "cross-memory attach" in line:
                said.add(name)
        if auto:
            if via_shm or not said:
                raise Failed(f"auto: expected tcp for vLLM's torch KV cache, with the reason "
                             f"logged; logged by {sorted(said) or 'no engine'}; over shm: "
                             f"{via_shm or 'none'}")
            log(f"kvlane backend auto: tcp, no shm for torch memory (said in {len(said)} "
                "engine logs)")
            return
        if other or not via_shm:
            raise Failed(f"--kvlane-backend same-host: {len(via_shm)} peers went over shm; "
                         f"others: {other or 'none logged'}")
        log(f"kvlane backend: {len(via_shm)} peer connections over shm, none over another "
            "backend")

    def reference(self, prompts: List[List[int]], max_tokens: int) -> List[List[int]]:
        """A single instance's tokens for the changed prompts; checks that the
        unchanged prompts give other tokens (else the proof proves nothing)."""
        single = self.engine("single", "none")
        try:
            ref = [o["tokens"] for o in single.run([changed(p) for p in prompts],
                                                    max_tokens=max_tokens)["outputs"]]
            orig = [o["tokens"] for o in single.run(prompts, max_tokens=max_tokens)["outputs"]]
        finally:
            single.stop()
        for p, r, o in zip(prompts, ref, orig):
            if r == o:
                raise Failed(f"a {len(p)}-token prompt gives the same tokens with its first token "
                             "changed: this model cannot prove that the KV was transferred")
        return ref


def pd_round(prefill: Engine, decode: Engine, prompts: List[List[int]],
             ref: List[List[int]], max_tokens: int, what: str) -> None:
    pre = prefill.run([changed(p) for p in prompts])
    kv = [o["kv"] for o in pre["outputs"]]
    if any(k is None for k in kv):
        raise Failed(f"{what}: prefill returned no kv_transfer_params: {pre}")
    dec = decode.run(prompts, kv, max_tokens=max_tokens)
    for p, want, o in zip(prompts, ref, dec["outputs"]):
        if o["finish"] == "error" or o["tokens"] != want:
            raise Failed(f"{what}: {len(p)}-token prompt: decode gave {o['tokens']} "
                         f"({o['finish']}), a single instance {want}")


def pd_pipelined(prefill: Engine, decode: Engine, prompts: List[List[int]],
                 ref: List[List[int]], max_tokens: int, what: str) -> int:
    """One request at a time, as a serving deployment runs them: prefill
    computes the next prompt while decode loads and decodes this one, so
    both engines' model threads are busy at once."""
    pending = prefill.send([changed(prompts[0])])
    for i, p in enumerate(prompts):
        pre = prefill.answer(pending)
        if i + 1 < len(prompts):
            pending = prefill.send([changed(prompts[i + 1])])
        kv = pre["outputs"][0]["kv"]
        if kv is None:
            raise Failed(f"{what}: prefill returned no kv_transfer_params: {pre}")
        o = decode.run([p], [kv], max_tokens=max_tokens)["outputs"][0]
        if o["finish"] == "error" or o["tokens"] != ref[i]:
            raise Failed(f"{what}: {len(p)}-token prompt: decode gave {o['tokens']} "
                         f"({o['finish']}), a single instance {ref[i]}")
    return len(prompts)


def expect_failed(decode: Engine, prompts: List[List[int]], kv: List[Any], max_tokens: int,
                  liveness: float, what: str) -> float:
    """Decode's loads of a lost prefill's blocks must all fail, within the
    liveness budget; returns how long that took."""
    t = time.monotonic()
    dec = decode.run(prompts, kv, max_tokens=max_tokens, timeout=liveness + 120)
    secs = time.monotonic() - t
    bad = [o for o in dec["outputs"] if o["finish"] != "error"]
    if bad:
        raise Failed(f"{what}: {len(bad)} of {len(kv)} requests did not fail: {bad}")
    if secs > liveness:
        raise Failed(f"{what}: decode failed the requests after {secs:.1f} s, "
                     f"past the liveness budget ({liveness} s)")
    return secs


def until_correct(prefill: Engine, decode: Engine, prompts: List[List[int]],
                  ref: List[List[int]], max_tokens: int, liveness: float, what: str) -> int:
    """P/D rounds until every request succeeds (at most 5); a request may
    fail meanwhile, never give wrong tokens. Returns the failed rounds."""
    for attempt in range(5):
        pre = prefill.run([changed(p) for p in prompts])
        outs = decode.run(prompts, [o["kv"] for o in pre["outputs"]],
                          max_tokens=max_tokens, timeout=liveness + 120)["outputs"]
        for p, want, o in zip(prompts, ref, outs):
            if o["finish"] != "error" and o["tokens"] != want:
                raise Failed(f"{what}: wrong tokens {o['tokens']} for a "
                             f"{len(p)}-token prompt (want {want})")
        if all(o["finish"] != "error" for o in outs):
            return attempt
        log(f"{what}: attempt {attempt}: "
            f"{sum(o['finish'] == 'error' for o in outs)} failed; again")
    raise Failed(f"{what}: decode never reached the prefill again")


def start_hogs(n: int) -> List[subprocess.Popen]:
    """`n` processes spinning on the last CPU, the core vLLM's CPU worker
    reserves for its KV transport (and where kvlane's threads then run):
    model threads of other engines on the same host, at their worst."""
    last = max(os.sched_getaffinity(0))
    code = f"import os; os.sched_setaffinity(0, [{last}])\nwhile True: pass"
    return [subprocess.Popen([sys.executable, "-c", code]) for _ in range(n)]


def check_placement(a: argparse.Namespace, connector: str, *engines: Engine) -> None:
    """kvlane.vllm gives the worker thread back the CPUs vLLM's CPU worker
    bound it to (one of its engine's cores) after vLLM's NIXL worker
    narrowed it to the last core of the host. Checked with `split`, where
    the prefill's cores exclude the last one."""
    for e in engines:
        got = e.worker_cpus()
        bound = placement(a.placement, e.role).get("VLLM_CPU_OMP_THREADS_BIND")
        log(f"{e.name}: worker thread on CPUs {got} (its engine's cores: {bound or 'all'})")
        if connector != "nixl" and bound and not set(got) <= {int(x) for x in bound.split(",")}:
            raise Failed(f"{e.name}: the worker thread runs on CPUs {got}, outside its engine's "
                         f"cores {bound} (kvlane.vllm restores the placement vLLM's NIXL "
                         "worker narrowed)")


def check(a: argparse.Namespace) -> int:
    hogs = start_hogs(a.hogs)
    try:
        return check_cases(a)
    finally:
        for h in hogs:
            h.kill()
            h.wait()


def check_cases(a: argparse.Namespace) -> int:
    s = Setup(a)
    c = a.connector
    env = s.connector_env(c)
    max_tokens = 6
    prompts = make_prompts(CHECK_LENGTHS, seed=7)
    ref = s.reference(prompts, max_tokens)
    log(f"reference tokens for {len(prompts)} prompts ({CHECK_LENGTHS} tokens)")
    cases = a.cases.split(",")
    failures: List[str] = []
    penv = dict(env)
    extra = {"kv_lease_duration": LEASE_S}
    penv["PD_KV_EXTRA"] = json.dumps(extra)
    prefill = s.engine("prefill", c, penv, side_port=s.port)
    decode = s.engine("decode", c, env, side_port=s.port + 1)
    prefill.ready()
    decode.ready()
    try:
        check_placement(a, c, prefill, decode)
        if "pd" in cases:
            n = 0
            for r in range(a.repeats):
                pd_round(prefill, decode, prompts, ref, max_tokens, f"repeat {r} batched")
                n += len(prompts)
                n += pd_pipelined(prefill, decode, prompts, ref, max_tokens,
                                  f"repeat {r} one by one")
                log(f"pd: repeat {r}: {n} requests correct so far")
            s.check_backend()
            log(f"PASS pd: {n} requests over {a.repeats} repeats, batched and one by one, "
                "every one equal to the single instance's tokens for the changed prompt"
                + (f" (kvlane backend {a.kvlane_backend})" if a.kvlane_backend else ""))

        if "kill-decode" in cases:
            # Blocks decode is loading when it dies, and blocks whose
            # params never reach it: prefill must free the latter when their
            # lease ends (the former too, unless decode read them first).
            pre = prefill.run([changed(p) for p in prompts])
            orphans = prefill.run([changed(p) for p in prompts[:3]])
            kv = [o["kv"] for o in pre["outputs"]]
            rid = decode.send(prompts, kv, max_tokens=max_tokens)
            time.sleep(0.05)
            decode.kill()
            log(f"kill-decode: decode killed with request {rid} loading "
                f"{sum(len(p) for p in prompts)} tokens")
            # Prefill keeps serving...
            pre2 = prefill.run([changed(p) for p in prompts[:2]])
            if any(o["kv"] is None for o in pre2["outputs"]):
                raise Failed("kill-decode: prefill stopped serving after decode died")
            # ...and frees the orphaned blocks when their lease ends.
            ids = [o["kv"]["remote_request_id"] for o in orphans["outputs"]]
            deadline = time.monotonic() + LEASE_S + 60
            while True:
                text = prefill.log_text()
                left = [i for i in ids if f"Releasing expired KV blocks for request {i} " not in text]
                if not left:
                    break
                if time.monotonic() > deadline:
                    raise Failed(f"kill-decode: prefill did not release the blocks of {left} "
                                 f"within the {LEASE_S} s lease (+60 s)")
                time.sleep(1)
            log(f"kill-decode: prefill released the blocks of {len(ids)} orphaned requests "
                "at the lease")
            decode = s.engine("decode", c, env, side_port=s.port + 1)
            pd_round(prefill, decode, prompts, ref, max_tokens, "kill-decode: new decode")
            log("PASS kill-decode: prefill kept serving, freed the blocks, a new decode works")

        if "kill-prefill" in cases:
            pre = prefill.run([changed(p) for p in prompts])
            kv = [o["kv"] for o in pre["outputs"]]
            prefill.kill()
            secs = expect_failed(decode, prompts, kv, max_tokens, a.liveness, "kill-prefill")
            log(f"kill-prefill: decode failed all {len(kv)} requests in {secs:.2f} s")
            # Decode keeps serving: a request of its own, then a new prefill.
            own = decode.run([prompts[0]], max_tokens=max_tokens)
            if own["outputs"][0]["finish"] == "error":
                raise Failed("kill-prefill: decode stopped serving")
            prefill = s.engine("prefill", c, penv, side_port=s.port + 2)
            pd_round(prefill, decode, prompts, ref, max_tokens, "kill-prefill: new prefill")
            log("PASS kill-prefill: decode failed the lost requests in time and kept serving")

        if "stop-prefill" in cases:
            # A prefill that stops answering without closing anything (a
            # hung host): only keep-alive can tell. SIGSTOP freezes its
            # processes with their sockets open.
            pre = prefill.run([changed(p) for p in prompts])
            kv = [o["kv"] for o in pre["outputs"]]
            try:
                log(f"stop-prefill: every thread of the prefill stopped "
                    f"{prefill.stop_all() * 1e3:.0f} ms after SIGSTOP")
                secs = expect_failed(decode, prompts, kv, max_tokens, a.liveness, "stop-prefill")
            finally:
                os.killpg(prefill.proc.pid, signal.SIGCONT)
            log(f"stop-prefill: decode failed all {len(kv)} requests of the frozen prefill "
                f"in {secs:.2f} s")
            attempt = until_correct(prefill, decode, prompts, ref, max_tokens, a.liveness,
                                    "stop-prefill: after resume")
            log(f"PASS stop-prefill: failed within the liveness budget, correct again "
                f"after {attempt} failed attempt(s) once it resumed")

        if "restart-prefill" in cases:
            port = s.port + 3
            ident = {"PD_ENGINE_ID": "prefill-restarted"}
            prefill.kill()
            prefill = s.engine("prefill", c, {**penv, **ident}, side_port=port)
            pd_round(prefill, decode, prompts, ref, max_tokens, "restart-prefill: first")
            pre_old = prefill.run([changed(p) for p in prompts])
            prefill.kill()
            prefill = s.engine("prefill", c, {**penv, **ident}, side_port=port)
            # A request prepared against the old incarnation's blocks: it must
            # fail, never read the new one's memory at those block ids.
            old = decode.run(prompts, [o["kv"] for o in pre_old["outputs"]],
                             max_tokens=max_tokens, timeout=a.liveness + 120)
            for o in old["outputs"]:
                if o["finish"] != "error":
                    raise Failed(f"restart-prefill: a request for the old incarnation's blocks "
                                 f"ended {o['finish']} with tokens {o['tokens']}")
            attempt = until_correct(prefill, decode, prompts, ref, max_tokens, a.liveness,
                                    "restart-prefill")
            log(f"PASS restart-prefill: old-incarnation requests failed, new ones correct "
                f"after {attempt} failed attempt(s)")
    except Failed as e:
        failures.append(str(e))
        log(f"FAIL {e}")
    finally:
        prefill.kill()
        decode.kill()
    log(f"logs in {s.logdir}")
    return 1 if failures else 0


# Rows with a prefill call time only.
NO_LOAD = ("none", "null", "none-pd")


def bench(a: argparse.Namespace) -> int:
    s = Setup(a)
    lengths = [int(x) for x in a.lengths.split(",")]
    rows: Dict[str, Dict[int, Dict[str, float]]] = {}
    for c in a.connectors.split(","):
        rows[c] = {}
        if c in ("none", "null"):
            # On the cores a prefill engine gets, for a like-for-like call
            # time. `null` (null_connector.py) is vLLM's connector machinery
            # with no transport: prefill calls only, nothing to load.
            if c == "none":
                e = s.engine("single", "none", cores_of="prefill")
            else:
                e = s.engine("prefill", "null", {"PYTHONPATH": HERE}, side_port=s.port)
            try:
                for n in lengths:
                    ps = make_prompts([n] * (a.reps + 1), seed=n)
                    t = [e.run([p], max_tokens=1)["secs"] for p in ps][1:]
                    rows[c][n] = {"prefill": statistics.median(t)}
                    log(f"{c} {n}: prefill {rows[c][n]['prefill'] * 1e3:.1f} ms")
            finally:
                e.stop()
            continue
        if c == "none-pd":
            # No connector, in the deployment a connector runs in: a
            # decode engine on its own cores beside prefill, called after
            # each prefill call (it computes the prompt itself, as long as
            # a load takes at these sizes). vLLM's workers busy-wait for
            # up to 1 s after each step (shm_broadcast's `busy_loop_s`), so
            # an engine that just ran keeps its core busy; beside a lone
            # engine (`none`) the prefill engine's unbound threads have the
            # other core to themselves, beside a decode engine they do not.
            e = s.engine("single", "none", cores_of="prefill")
            d = s.engine("single", "none", cores_of="decode")
            try:
                e.ready()
                d.ready()
                for n in lengths:
                    ps = make_prompts([n] * (a.reps + 1), seed=n)
                    t = []
                    for p in ps:
                        t.append(e.run([p], max_tokens=1)["secs"])
                        d.run([p], max_tokens=1)
                    rows[c][n] = {"prefill": statistics.median(t[1:])}
                    log(f"{c} {n}: prefill {rows[c][n]['prefill'] * 1e3:.1f} ms")
            finally:
                e.stop()
                d.stop()
            continue
        env = s.connector_env(c)
        pre = s.engine("prefill", c, env, side_port=s.port)
        dec = s.engine("decode", c, env, side_port=s.port + 1)
        try:
            pre.ready()
            dec.ready()
            for n in lengths:
                ps = make_prompts([n] * (a.reps + 1), seed=n)
                tp, tl = [], []
                for i, p in enumerate(ps):
                    r = pre.run([p])
                    d = dec.run([p], [r["outputs"][0]["kv"]], max_tokens=1)
                    if d["outputs"][0]["finish"] == "error":
                        raise Failed(f"bench {c}: a {n}-token load failed")
                    if i:  # the first one pays for the handshake
                        tp.append(r["secs"])
                        tl.append(d["secs"])
                rows[c][n] = {"prefill": statistics.median(tp), "load": statistics.median(tl)}
                log(f"{c} {n}: prefill {rows[c][n]['prefill'] * 1e3:.1f} ms, "
                    f"load {rows[c][n]['load'] * 1e3:.1f} ms")
        finally:
            pre.stop()
            dec.stop()
    print(json.dumps(rows))
    print()
    print("| prompt tokens | " + " | ".join(
        f"{c} prefill call (ms)" + ("" if c in NO_LOAD else f" | {c} KV load (ms)")
        for c in rows) + " |")
    print("|" + "---|" * (1 + sum(1 if c in NO_LOAD else 2 for c in rows)))
    for n in lengths:
        cells = []
        for c in rows:
            cells.append(f"{rows[c][n]['prefill'] * 1e3:.1f}")
            if c not in NO_LOAD:
                cells.append(f"{rows[c][n]['load'] * 1e3:.1f}")
        print(f"| {n} | " + " | ".join(cells) + " |")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("check", "bench"):
        p = sub.add_parser(name)
        p.add_argument("--workdir", help="model and logs (default: a new temporary folder)")
        p.add_argument("--side-port", type=int, default=25600,
                       help="prefill's side channel port (others use the next few)")
        p.add_argument("--placement", choices=["split", "shared"], default="split",
                       help="split: prefill and decode on cores of their own (see "
                            "placement()); shared: both on every core")
    c = sub.choices["check"]
    c.add_argument("--connector", choices=["kvlane", "nixl", "nixl-placed"], default="kvlane")
    c.add_argument("--kvlane-backend", choices=["auto", "tcp", "same-host", "shm"],
                   help="KVLANE_BACKEND for the kvlane engines (default: the environment's, "
                   "else auto); same-host and shm turn on cross-memory attach, and "
                   "same-host checks that every peer went over shm")
    c.add_argument("--repeats", type=int, default=10)
    c.add_argument("--cases",
                   default="pd,kill-decode,kill-prefill,stop-prefill,restart-prefill")
    c.add_argument("--hogs", type=int, default=0,
                   help="processes spinning on the last CPU (kvlane's core in vLLM) throughout")
    c.add_argument("--liveness", type=float, default=15.0,
                   help="seconds within which decode must fail requests of a dead prefill")
    b = sub.choices["bench"]
    b.add_argument("--connectors", default="none,nixl,nixl-placed,kvlane",
                   help="nixl-placed: NIXL with kvlane.vllm's placement of the worker thread; "
                        "null: vLLM's connector machinery without a transport (prefill "
                        "calls only, null_connector.py); none-pd: no connector, with a "
                        "decode engine beside prefill called after each prefill call")
    b.add_argument("--lengths", default="100,1000,4000")
    b.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    try:
        return check(a) if a.cmd == "check" else bench(a)
    except Failed as e:
        log(f"FAIL {e}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
