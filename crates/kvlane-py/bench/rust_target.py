"""Starting a Rust `kvlane bench --role target` and waiting until it
listens: shared by `bench.py` (its `--rust` rows) and `ci/bench-ab.py`.
Standard library only (`ci/bench-ab.py` runs without numpy)."""

import contextlib
import select
import subprocess
import tempfile
import time


def wait_listening(target, timeout, log):
    """Waits for the `listening HOST:PORT ...` line of a `kvlane bench
    --role target` (printed once its pool is filled: every page touched,
    which takes seconds where first touches are slow) and returns the
    address it listens on. `log` holds the target's stderr, quoted when it
    exits or never listens."""
    def why():
        log.seek(0)
        return "".join(log.read().decode(errors="replace").splitlines(keepends=True)[-10:])
    end = time.monotonic() + timeout
    while True:
        left = end - time.monotonic()
        if left <= 0 or not select.select([target.stdout], [], [], left)[0]:
            raise TimeoutError(f"the kvlane bench target did not listen within {timeout} s; its stderr:\n{why()}")
        line = target.stdout.readline()
        if not line:
            raise EOFError(f"the kvlane bench target exited ({target.wait()}); its stderr:\n{why()}")
        if line.startswith("listening "):
            return line.split()[1]


@contextlib.contextmanager
def running(binary, pool, timeout=120):
    """Runs `binary bench --role target --backend tcp` on 127.0.0.1, port 0
    (the system picks a free port, which the `listening` line names: a
    fixed port could be one the system had just handed out as the local
    port of some outgoing connection; then the target exited), with a
    `pool` of memory, and yields the address it listens on; the target is
    killed on the way out."""
    with tempfile.TemporaryFile() as log:
        target = subprocess.Popen([binary, "bench", "--role", "target", "--backend", "tcp",
                                   "--listen", "127.0.0.1:0", "--pool", pool],
                                  stdout=subprocess.PIPE, stderr=log, text=True)
        try:
            yield wait_listening(target, timeout, log)
        finally:
            target.kill()
            target.wait()
