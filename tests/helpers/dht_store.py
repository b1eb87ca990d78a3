"""Storing from inside a DHT node's process, as any program on that node could: the way tests write what an attacker
would, with hivemind's node API and no validator of ours in between."""

from __future__ import annotations

from hivemind.utils import get_dht_time

from swarm.dht.node import dht_result


class Padding:
    """`size` zero bytes, made inside the node's process: the pipe into it does not carry a megabyte in one message."""

    def __init__(self, size: int, text: bool = False):
        self.size, self.text = size, text

    def make(self):
        return "x" * self.size if self.text else b"\x00" * self.size


class StoreInNode:
    """Store one value (picklable for run_coroutine); a subkey or value given as (prefix, Padding) is padded there."""

    def __init__(self, key, subkey, value, expiration_s: float):
        self.key, self.subkey, self.value, self.expiration_s = key, subkey, value, expiration_s

    async def __call__(self, dht, node) -> bool:
        subkey, value = (_made(item) for item in (self.subkey, self.value))
        return bool(await node.store(self.key, value, get_dht_time() + self.expiration_s, subkey=subkey))


def _made(item):
    if isinstance(item, Padding):
        return item.make()
    if isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], Padding):
        return item[0] + item[1].make()
    return item


def store_in_node(node, key, subkey, value, expiration_s: float = 60.0) -> bool:
    """Whether some node took it (hivemind's answer: the last replica's)."""
    return dht_result(
        node, node.run_coroutine(StoreInNode(key, subkey, value, expiration_s), return_future=True), "store"
    )
