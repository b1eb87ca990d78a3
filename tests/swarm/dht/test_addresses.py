"""The multiaddr a node announces for a public host."""

import pytest

from swarm.dht.addresses import announce_maddr


@pytest.mark.parametrize(
    "host, maddr",
    [
        ("203.0.113.7", "/ip4/203.0.113.7/tcp/31337"),
        ("2001:db8::1", "/ip6/2001:db8::1/tcp/31337"),
        ("boot.example.org", "/dns/boot.example.org/tcp/31337"),
    ],
)
def test_an_address_or_a_name_becomes_its_multiaddr(host, maddr):
    assert announce_maddr(host, 31337) == maddr


@pytest.mark.parametrize(
    "host, port, said",
    [
        ("203.0.113.7", 0, "needs a fixed port"),
        ("203.0.113.7", 70000, "needs a fixed port"),
        ("a/b", 1, "IP address or a DNS name"),
        ("", 1, "IP address or a DNS name"),
    ],
)
def test_what_others_cannot_dial_is_refused(host, port, said):
    with pytest.raises(ValueError, match=said):
        announce_maddr(host, port)
