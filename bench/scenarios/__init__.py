"""One module per scenario; each returns `bench.stats.Row`s.

decode       batch-1 greedy decode step latency vs the local HF model with its DynamicCache
prefill      prompt processing time (and tokens/s) vs local
train        forward+backward through the remote blocks, tokens/s vs local (blocks frozen on both sides)
concurrency  1..8 clients generating at once against the same peers: aggregate tokens/s, per-client latency
api          `swarmlm api` (streamed, greedy) vs the Python client's generate(): time to first token, tokens/s
startup      peer start-up time to ONLINE, and each peer's resident memory vs the whole local model
wire         per-hop cost of our RPC vs a bare gRPC echo of the same bytes, and vs hivemind's P2P
train_swarm  training peers + `swarmlm train` vs `--local`: loss curves, tokens/s, all-reduce cost, pipelining
"""
