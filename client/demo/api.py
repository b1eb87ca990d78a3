"""`swarmlm demo --api`: the demo swarm plus `swarmlm api` and `swarmlm monitor` on it, until Ctrl+C.

The API server and the monitor are the real commands, started as children of the demo's LocalSwarm like its
peers, so that stopping the swarm stops them too; their URLs are read from the lines they print once ready.
"""

from __future__ import annotations

import argparse
import re
import socket
import time
from pathlib import Path

from client.demo.local_swarm import LocalSwarm, split_blocks
from swarm.models.checkpoint import load_config

_START_TIMEOUT_S = 180.0
_API_LINE = re.compile(r"swarmlm api: serving (\S+) at (http://\S+/v1)")
_MONITOR_LINE = re.compile(r"monitor: (http://\S+/) ")


def check_ports(host: str, ports: dict[str, int]) -> None:
    """SystemExit naming the flag whose port is taken, before anything is started (0: any free port, never taken)."""
    for flag, port in ports.items():
        if not 0 <= port <= 65535:
            raise SystemExit(f"error: {flag} must lie in 0..65535, got {port}")
        if port == 0:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, port))
            except OSError as exc:
                raise SystemExit(
                    f"error: cannot listen on {host}:{port}: {exc.strerror or exc}; choose another "
                    f"{flag} (0: a free one)"
                ) from None


def wait_for_line(swarm: LocalSwarm, name: str, pattern: re.Pattern, timeout_s: float) -> re.Match:
    """The first line of child `name`'s log that matches `pattern`; RuntimeError if the child exits first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        match = pattern.search(swarm.log(name).read_text())
        if match:
            return match
        child = swarm.children[name]
        if child.poll() is not None:
            raise RuntimeError(f"{name} exited with code {child.returncode}: {swarm.tail(name)}")
        time.sleep(0.1)
    raise TimeoutError(f"{name} was not ready within {timeout_s:.0f}s; its log: {swarm.log(name)}")


def start_demo_swarm(swarm: LocalSwarm, model_path: Path, cache_dir: Path, peers: int):
    """A bootstrap node and `peers` peers splitting the model's blocks, each line printed as it starts; returns
    (the bootstrap's multiaddrs, the model's block count, the spans). The peers may still be loading."""
    num_blocks = load_config(model_path).num_hidden_layers
    spans = split_blocks(num_blocks, max(1, min(peers, num_blocks)))
    maddrs = swarm.start_bootstrap()
    print(f"bootstrap node: {maddrs[0]}")
    for i, (start, end) in enumerate(spans):
        swarm.start_peer(f"peer{i}", str(model_path), "--blocks", f"{start}:{end}", "--cache-dir", str(cache_dir))
        print(f"peer {i}: blocks {start}:{end}  (log: {swarm.log(f'peer{i}')})")
    return maddrs, num_blocks, spans


def run_with_api(args: argparse.Namespace, model_path: Path, cache_dir: Path, swarm: LocalSwarm) -> int:
    """Start the swarm, the API server and the monitor, print their URLs, then wait for Ctrl+C (KeyboardInterrupt)."""
    key_args = ("--swarm-key", args.swarm_key) if args.swarm_key else ()
    began = time.monotonic()
    maddrs, num_blocks, spans = start_demo_swarm(swarm, model_path, cache_dir, args.peers)
    # the API and the monitor start while the peers load: both wait for blocks themselves
    swarm.start(
        "api",
        "api",
        str(model_path),
        "--initial-peers",
        *maddrs,
        "--host",
        "127.0.0.1",
        "--port",
        str(args.port),
        "--cache-dir",
        str(cache_dir),
        *key_args,
    )
    swarm.start(
        "monitor",
        "monitor",
        "--initial-peers",
        *maddrs,
        "--host",
        "127.0.0.1",
        "--port",
        str(args.monitor_port),
        *key_args,
    )
    swarm.wait_online(str(model_path), num_blocks, spans, timeout_s=_START_TIMEOUT_S)
    api = wait_for_line(swarm, "api", _API_LINE, _START_TIMEOUT_S)
    monitor = wait_for_line(swarm, "monitor", _MONITOR_LINE, _START_TIMEOUT_S)
    model_id, api_url = api.group(1), api.group(2)
    print(f"swarm ready in {time.monotonic() - began:.1f}s\n")
    print(f"API:     {api_url}  (log: {swarm.log('api')})")
    print(f"monitor: {monitor.group(1)}  (log: {swarm.log('monitor')})")
    print(
        f"try:     curl {api_url}/chat/completions -H 'Content-Type: application/json' "
        f'-d \'{{"model": "{model_id}", "messages": [{{"role": "user", "content": "Hello!"}}], '
        f'"max_tokens": 32}}\''
    )
    print("running until Ctrl+C", flush=True)
    while True:
        for name, child in swarm.children.items():
            if child.poll() is not None:
                raise RuntimeError(f"{name} exited with code {child.returncode}: {swarm.tail(name)}")
        time.sleep(0.5)
