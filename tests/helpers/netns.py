"""A home network behind NAT, built from Linux network namespaces, for tests of peers that cannot be reached.

    root ns (the test) --veth-- "public" ns: bridge, 10.177.0.2 --veth-- "router" ns --veth-- "home" ns: 10.178.0.2
                               10.177.0.254                          10.177.0.1 | 10.178.0.1

The router masquerades what home sends to the public side and forwards nothing the public side starts (nftables),
as a home router does. The public side has no route to 10.178.0.0/24 at all. The test process is on the public
side too (it reaches 10.177.0.2 through its own veth), so it can watch the DHT and be the client.

`nat_network()` creates everything under names unique to this process and removes it all on the way out,
failure or not: the namespaces' processes are killed, then the namespaces and links deleted.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

PUBLIC_IP, ROUTER_PUBLIC_IP, ROOT_IP = "10.177.0.2", "10.177.0.1", "10.177.0.254"
HOME_IP, ROUTER_HOME_IP = "10.178.0.2", "10.178.0.1"


@dataclass(frozen=True)
class NatNetwork:
    public: str  # namespace names
    router: str
    home: str

    def exec_prefix(self, namespace: str) -> list[str]:
        """The command prefix that runs a program inside `namespace` (the program keeps its pid)."""
        return ["ip", "netns", "exec", namespace]


def unavailable_reason() -> str | None:
    """Why namespaces cannot be built here, or None when they can."""
    if os.geteuid() != 0:
        return "building network namespaces needs root"
    for tool in ("ip", "nft"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (Debian: apt-get install iproute2 nftables)"
    probe = f"swarmlm-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _run(*args: str) -> None:
    done = subprocess.run(list(args), capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"`{' '.join(args)}` failed: {done.stderr.strip()}")


def _in(namespace: str, *args: str) -> None:
    _run("ip", "netns", "exec", namespace, *args)


ROUTER_RULES = """
table ip nat {{
    chain postrouting {{
        type nat hook postrouting priority srcnat; policy accept;
        oifname "{wan}" masquerade
    }}
}}
table ip filter {{
    chain forward {{
        type filter hook forward priority filter; policy drop;
        ct state established,related accept
        iifname "{lan}" oifname "{wan}" accept
    }}
}}
"""


@contextmanager
def nat_network() -> Iterator[NatNetwork]:
    tag = f"{os.getpid() % 100000}"
    net = NatNetwork(public=f"swarmlm-{tag}-pub", router=f"swarmlm-{tag}-rtr", home=f"swarmlm-{tag}-home")
    # link names are at most 15 characters
    root_veth, root_peer = f"sw{tag}r", f"sw{tag}rp"
    wan, wan_peer = f"sw{tag}w", f"sw{tag}wp"
    lan, lan_peer = f"sw{tag}l", f"sw{tag}lp"
    try:
        for namespace in (net.public, net.router, net.home):
            _run("ip", "netns", "add", namespace)
            _in(namespace, "ip", "link", "set", "lo", "up")
        _in(net.public, "ip", "link", "add", "br0", "type", "bridge")
        _in(net.public, "ip", "addr", "add", f"{PUBLIC_IP}/24", "dev", "br0")
        _in(net.public, "ip", "link", "set", "br0", "up")
        # the test's own way onto the public side
        _run("ip", "link", "add", root_veth, "type", "veth", "peer", "name", root_peer)
        _run("ip", "link", "set", root_peer, "netns", net.public)
        _run("ip", "addr", "add", f"{ROOT_IP}/24", "dev", root_veth)
        _run("ip", "link", "set", root_veth, "up")
        _in(net.public, "ip", "link", "set", root_peer, "master", "br0", "up")
        # the router's public side
        _run(
            "ip", "link", "add", wan, "netns", net.router, "type", "veth", "peer", "name", wan_peer, "netns", net.public
        )
        _in(net.public, "ip", "link", "set", wan_peer, "master", "br0", "up")
        _in(net.router, "ip", "addr", "add", f"{ROUTER_PUBLIC_IP}/24", "dev", wan)
        _in(net.router, "ip", "link", "set", wan, "up")
        # home, behind it
        _run("ip", "link", "add", lan, "netns", net.router, "type", "veth", "peer", "name", lan_peer, "netns", net.home)
        _in(net.router, "ip", "addr", "add", f"{ROUTER_HOME_IP}/24", "dev", lan)
        _in(net.router, "ip", "link", "set", lan, "up")
        _in(net.home, "ip", "addr", "add", f"{HOME_IP}/24", "dev", lan_peer)
        _in(net.home, "ip", "link", "set", lan_peer, "up")
        _in(net.home, "ip", "route", "add", "default", "via", ROUTER_HOME_IP)
        _in(net.router, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1")
        rules = subprocess.run(
            ["ip", "netns", "exec", net.router, "nft", "-f", "-"],
            input=ROUTER_RULES.format(wan=wan, lan=lan),
            capture_output=True,
            text=True,
            timeout=30,
        )
        if rules.returncode != 0:
            raise RuntimeError(f"nft rules for the router failed: {rules.stderr.strip()}")
        yield net
    finally:
        for namespace in (net.home, net.router, net.public):
            _kill_processes_in(namespace)
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True, timeout=30)
        subprocess.run(["ip", "link", "del", root_veth], capture_output=True, timeout=30)  # gone with its peer


def _kill_processes_in(namespace: str, timeout_s: float = 10.0) -> None:
    """SIGKILL whatever still runs inside `namespace`, and wait until it is gone."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        listed = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True, timeout=30)
        pids = [int(pid) for pid in listed.stdout.split()] if listed.returncode == 0 else []
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)


def leftover_namespaces() -> list[str]:
    """Namespaces of this process that still exist (none should, once `nat_network` has exited)."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30)
    mine = f"swarmlm-{os.getpid() % 100000}-"
    return [line.split()[0] for line in listed.stdout.splitlines() if line.startswith(mine)]
