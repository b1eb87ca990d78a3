"""Who is who, and who may take part: keys, signatures and the gates of a private swarm.

- identity: a node's key (its libp2p identity), which signs its records and proves who answers at an address
- swarmkey: key files of private swarms, and the keys derived from them
- dhtauth: the HMAC on every DHT message of a private swarm
- rpcauth: TLS and a per-call tag on the data plane of a private swarm

May import protocol and swarm's own helpers (runtime, paths, progress, extras); nothing else of swarm.
"""
