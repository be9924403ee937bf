"""asyncio glue: awaiting a transfer, and async iteration of notifications
and peer events. The native side signals completion from its own thread;
the result is handed to the loop with ``call_soon_threadsafe``."""

import asyncio
from typing import AsyncIterator, Generator

# How long one blocking receive may hold an executor thread.
_SLICE = 0.1


def _settle(fut: "asyncio.Future[None]", handle) -> None:
    if fut.done():
        return
    err = handle.error()
    if err is None:
        fut.set_result(None)
    else:
        fut.set_exception(err)


def await_transfer(handle) -> Generator:
    """``Transfer.__await__``: a future settled when the transfer ends."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()
    handle.add_done_callback(lambda: loop.call_soon_threadsafe(_settle, fut, handle))
    return fut.__await__()


async def aiter_notifications(agent) -> AsyncIterator:
    """Notifications of ``agent`` as an async iterator (ends when it closes)."""
    stream = agent.notifications()
    loop = asyncio.get_running_loop()
    while not agent.closed:
        note = await loop.run_in_executor(None, stream.recv, _SLICE)
        if note is not None:
            yield note


async def aiter_events(agent) -> AsyncIterator:
    """Peer events of ``agent`` from now on, as an async iterator."""
    stream = agent.events()
    loop = asyncio.get_running_loop()
    while not agent.closed:
        ev = await loop.run_in_executor(None, stream.recv, _SLICE)
        if ev is not None:
            yield ev
