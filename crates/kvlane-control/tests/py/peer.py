"""pyzmq + msgpack peer for kvlane-control interop tests.

Usage: peer.py interop HOST:PORT   -- hello/hello_ack, ping/pong, notify, bye
       peer.py garbage HOST:PORT   -- malformed frames, then a proper hello
Exits 0 and prints OK on success; prints the failure and exits 1 otherwise.
"""
import os
import random
import sys

try:
    import msgpack
    import zmq
except ImportError as e:  # fail loudly, never skip
    print(f"missing python module ({e}); run: pip install pyzmq msgpack", file=sys.stderr)
    sys.exit(3)

VERSION = 2


def hello(engine):
    return {
        "type": "hello",
        "version": VERSION,
        "engine_id": engine,
        "incarnation": random.getrandbits(64),
        "dp_rank": 0,
        "tp_rank": 0,
        "tp_size": 1,
        "fingerprint": "fp",
        "capabilities": ["py"],
        "auth": False,
        "nonce": b"",
        "data_plane": b"py-blob",
        "some_future_field": "ignored",
    }


def recv_until(sock, kind, timeout_ms=5000):
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    while True:
        if not poller.poll(timeout_ms):
            raise SystemExit(f"timed out waiting for {kind}")
        frames = sock.recv_multipart()
        msg = msgpack.unpackb(frames[-1], raw=False)
        if msg.get("type") == "ping":
            sock.send(msgpack.packb({"type": "pong", "version": VERSION, "seq": msg["seq"], "incarnation": 1}, use_bin_type=True))
            continue
        if msg.get("type") == kind:
            return msg
        raise SystemExit(f"expected {kind}, got {msg}")


def main():
    mode, addr = sys.argv[1], sys.argv[2]
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.setsockopt(zmq.IDENTITY, os.urandom(8))
    sock.connect(f"tcp://{addr}")
    if mode == "garbage":
        sock.send(b"\xc1\xc1\xc1 not msgpack")
        sock.send(msgpack.packb({"type": "teleport", "version": VERSION}, use_bin_type=True))
        sock.send(msgpack.packb([1, 2, 3], use_bin_type=True))
        sock.send(msgpack.packb({"type": "hello", "version": VERSION}, use_bin_type=True))
        sock.send(b"\x00" * (17 << 20))
        sock.send_multipart([b"", b"\x93\x01"])
        sock.send(b"")
    h = hello("py-" + mode)
    sock.send(msgpack.packb(h, use_bin_type=True))
    ack = recv_until(sock, "hello_ack")
    assert ack["version"] == VERSION, ack
    assert isinstance(ack["data_plane"], bytes), ack
    if mode == "interop":
        sock.send(msgpack.packb({"type": "ping", "version": VERSION, "seq": 7, "incarnation": h["incarnation"]}, use_bin_type=True))
        pong = recv_until(sock, "pong")
        assert pong["seq"] == 7, pong
        sock.send(msgpack.packb({"type": "notify", "version": VERSION, "transfer_id": 99, "payload": b"from-python"}, use_bin_type=True))
        sock.send(msgpack.packb({"type": "bye", "version": VERSION}, use_bin_type=True))
        recv_until(sock, "bye")
    sock.close()
    ctx.term()
    print("OK", ack["engine_id"])


if __name__ == "__main__":
    main()
