"""asyncio glue: awaiting a transfer, and async iteration of notifications
and peer events (``async for note in agent.notifications()``). The native side signals completion from its own thread;
the result is handed to the loop with ``call_soon_threadsafe``."""

import asyncio
from typing import Generator

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


async def anext_stream(stream):
    """``Notifications.__anext__`` / ``PeerEvents.__anext__``: the next item,
    received on an executor thread in slices; ends when the agent closed."""
    loop = asyncio.get_running_loop()
    while True:
        item = await loop.run_in_executor(None, stream.recv, _SLICE)
        if item is not None:
            return item
        if stream.closed:
            raise StopAsyncIteration
