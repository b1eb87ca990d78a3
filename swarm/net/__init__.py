"""Transport beyond direct TCP: gRPC through libp2p streams, relays, reachability.

- tunnel: gRPC through libp2p streams, for peers that cannot be connected to
- relay: public members that forward those streams to peers behind NAT
- reachability: asking neighbours whether they can connect to a peer

May import protocol, swarm.trust and swarm's own helpers (runtime, paths, progress, extras).
"""
