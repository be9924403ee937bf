"""Python reproducer of issue 40: two processes, each pinned to one core
(sched_setaffinity before the agent is built, as vLLM's worker does), with
spinning processes on that core, READ + notification in a loop."""
import os, sys, time, subprocess, threading
import numpy as np
import kvlane

ROLE = sys.argv[1]
CPU = int(os.environ.get("CPU", "0"))
SECS = float(os.environ.get("SECS", "30"))
BLOCK, N = 128 << 10, 4
KA = float(os.environ.get("KA", "0.2"))
BUDGET = int(os.environ.get("BUDGET", "5"))
DEADLINE = float(os.environ.get("DEADLINE", "10"))
STEP = int(os.environ.get("STEP", "2000"))
POLL = os.environ.get("POLL", "state")   # state | wait

CPU = int(os.environ.get("TCPU", CPU)) if ROLE == "target" else CPU
os.sched_setaffinity(0, {CPU})
t0 = time.monotonic()
def log(*a):
    print(f"[{ROLE} {time.monotonic()-t0:7.3f}]", *a, flush=True)

import ctypes
SPIN = int(os.environ.get("SPIN", "2"))
if SPIN:
    ctypes.CDLL(os.path.join(os.path.dirname(os.path.abspath(__file__)), "libspin.so")).start_spinners(SPIN)
mem = np.full(BLOCK * N, 7 if ROLE == "target" else 0, dtype=np.uint8)
a = kvlane.Agent(engine_id=ROLE, backend="tcp", regions=[mem], keepalive_interval=KA,
                 liveness_budget=BUDGET, transfer_deadline=DEADLINE)
ev = a.events()
bad = []
def check_events():
    while True:
        e = ev.recv(timeout=0)
        if e is None:
            return
        if e.kind not in ("up", "recovered", "closed"):
            log("EVENT", e.kind, e.addr, e.detail)
            bad.append(e.kind)

if ROLE == "target":
    print("ADDR", a.addr, mem.ctypes.data, flush=True)
    notes = a.notifications()
    n = 0
    import select
    while True:
        r, _, _ = select.select([sys.stdin], [], [], 0.001)
        if r:
            break
        n += len(notes.drain())
        check_events()
        # engine step: python work holding the GIL
        x = 0
        for i in range(STEP):
            x += i
    log("notes", n, "bad", bad)
    print("BAD" if bad else "OK", flush=True)
    a.close()
else:
    p = subprocess.Popen([sys.executable, __file__, "target"], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True, env=dict(os.environ))
    while True:
        line = p.stdout.readline()
        if not line:
            sys.exit("target died")
        if line.startswith("ADDR"):
            _, addr, raddr = line.split()
            raddr = int(raddr)
            break
        print(line, end="")
    ts = time.monotonic()
    try:
        peer = a.connect(addr)
    except Exception as e:
        log("CONNECT FAILED", type(e).__name__, e, "after", time.monotonic() - ts)
        bad.append("connect")
        peer = None
    n = 0
    worst = 0
    base = mem.ctypes.data
    local = [(base + i * BLOCK, BLOCK) for i in range(N)]
    remote = [(raddr + i * BLOCK, BLOCK) for i in range(N)]
    while peer is not None and time.monotonic() - t0 < SECS:
        s = time.monotonic()
        t = peer.read_spans(local, remote, notify=(b"blocks ready" if os.environ.get("NOTIFY", "1") == "1" else None))
        try:
            if POLL == "wait":
                t.wait()
            else:
                while t._poll_state() == "PROC":
                    check_events()
                    x = 0
                    for i in range(STEP):
                        x += i
                if t.status != "done":
                    t.wait()
        except Exception as e:
            log("TRANSFER FAILED", n, type(e).__name__, e, "after", time.monotonic() - s)
            bad.append("transfer")
            break
        d = time.monotonic() - s
        if d > worst:
            worst = d
            log(f"transfer {n}: {d*1000:.1f} ms (worst so far)")
        n += 1
        check_events()
        time.sleep(0.002)
    log("transfers", n, "worst", worst, "bad", bad)
    p.stdin.close()
    for line in p.stdout:
        print(line, end="")
    p.wait()
    a.close()
