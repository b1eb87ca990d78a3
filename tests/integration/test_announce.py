"""Several machines: a node listening on every interface announces the address it was told others reach it at.

On one host the test stands in 127.0.0.1 for the public address: the bootstrap listens on 0.0.0.0 and must print
only the announced multiaddr, a peer on 0.0.0.0 joins through it and announces its endpoint and DHT address at the
announced host, and a client generates through it.
"""

from __future__ import annotations

import socket

from protocol.records import prefix_for_model


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_bootstrap_and_a_peer_on_every_interface_announce_where_they_are_reached(swarm, tiny_llama_path):
    boot_port, grpc_port, dht_port = free_port(), free_port(), free_port()
    maddrs = swarm.start_bootstrap("--host", "0.0.0.0", "--port", str(boot_port), "--announce-host", "127.0.0.1")
    assert maddrs == [f"/ip4/127.0.0.1/tcp/{boot_port}/p2p/{maddrs[0].rsplit('/', 1)[1]}"], maddrs
    swarm.start_peer(
        tiny_llama_path,
        "--blocks",
        "0:4",
        "--host",
        "0.0.0.0",
        "--port",
        str(grpc_port),
        "--dht-port",
        str(dht_port),
        "--announce-host",
        "127.0.0.1",
    )
    prefix = prefix_for_model(str(tiny_llama_path))
    swarm.wait_online(prefix, [(0, 4)])
    (info,) = swarm.snapshot(prefix, 4).online().values()
    assert info.endpoint == f"127.0.0.1:{grpc_port}" and info.transport == "direct"


BAD = [
    (["bootstrap", "--announce-host", "127.0.0.1"], "needs a fixed port"),
    (["bootstrap", "--port", "1", "--announce-host", "a/b"], "IP address or a DNS name"),
    (["peer", "{model}", "--blocks", "0:4", "--host", "0.0.0.0"], "pass --announce-host PUBLIC_IP"),
]


def test_an_address_others_cannot_dial_is_refused_at_once(swarm, tiny_llama_path):
    runs = [(swarm.spawn(args[0], *(a.format(model=tiny_llama_path) for a in args)), said) for args, said in BAD]
    for proc, said in runs:
        assert not proc.wait_gone(120), proc.logs()
        proc.expected_alive = False
        assert proc.returncode != 0 and said in proc.stderr() and "Traceback" not in proc.stderr(), proc.logs()
