"""A session's inbox (peer/inference.py): the kinds of work that come through it, and the reader that puts the
client's requests there.

The bytes of a request or a pushed step count as queued (peer/admission.py) from when it enters the inbox
(`held`) until the stream takes it, or `drain`s what is left when it ends.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc

from protocol import swarmlm_pb2 as pb
from protocol.packing import Received


@dataclass(frozen=True)
class ClientRequest:
    """A request the client sent on the stream: open, step or close."""

    received: Received
    held: int = 0  # its bytes, counted as queued (peer/admission.py) while it waits in the inbox


@dataclass(frozen=True)
class PushedStep:
    """A step that the previous peer of the route pushed into the session; `push` checked its token."""

    received: Received
    held: int = 0


@dataclass(frozen=True)
class PushFailed:
    """A step of ours that the next peer did not take: the client hears of it and sends its steps itself."""

    report: pb.ForwardFailed


@dataclass(frozen=True)
class StreamEnded:
    """The client's stream ended or broke: so does the session."""


@dataclass(frozen=True)
class Reclaimed:
    """The session sat idle on its cache while another waited for room: it ends."""


InboxItem = ClientRequest | PushedStep | PushFailed | StreamEnded | Reclaimed


def held_bytes(item: InboxItem) -> int:
    """The queued bytes `item` holds while it waits (0 for what carries no message)."""
    return item.held if isinstance(item, (ClientRequest, PushedStep)) else 0


def drain(inbox: asyncio.Queue[InboxItem]) -> int:
    """Empty `inbox`; the bytes its items held."""
    held = 0
    while not inbox.empty():
        held += held_bytes(inbox.get_nowait())
    return held


def size_of(received: Received) -> int:
    """The bytes a received message holds: its payload, and the rest (small tensors travel inline)."""
    return len(received.payload) + received.message.ByteSize()


async def read_into(
    requests: AsyncIterator[Received], inbox: asyncio.Queue, slots: asyncio.Semaphore, hold: Callable[[int], int]
) -> None:
    """The client's requests into the session's inbox, each once a slot is free (its bytes held), then StreamEnded."""
    iterator = requests.__aiter__()
    try:
        while True:
            await slots.acquire()
            try:
                received = await iterator.__anext__()
            except StopAsyncIteration:
                return
            inbox.put_nowait(ClientRequest(received, hold(size_of(received))))
    except (grpc.RpcError, asyncio.CancelledError):
        pass
    finally:
        inbox.put_nowait(StreamEnded())
