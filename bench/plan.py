"""What one benchmark run does: `Plan`, with the quick and full presets the CLI starts from."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

SCENARIOS = (
    "offload",
    "decode",
    "prefill",
    "train",
    "wire",
    "concurrency",
    "api",
    "startup",
    "wan",
    "speculative",
    "moe",
    "train_swarm",
)
"""Every scenario, in the order they run (startup and memory are measured while the peers start)."""
QUICK_SCENARIOS = tuple(s for s in SCENARIOS if s not in ("train_swarm", "wan", "speculative", "offload", "moe"))
"""What --quick runs unless --scenarios says otherwise: train_swarm alone takes ~8 min on 2 cores; offload and moe
measure one peer's memory and experts in processes of their own (`--scenarios offload,moe`)."""
MODEL_SCENARIOS = ("decode", "prefill", "train", "concurrency", "api", "startup", "wan", "speculative")
DELAYED_SCENARIOS = ("wan", "speculative")
"""Scenarios run on a split whose peers are behind delaying proxies (bench/proxy.py)."""
"""Scenarios that need a swarm of peers serving a model."""
DEVICES = ("cpu", "cuda")
DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True, kw_only=True)
class Plan:
    """Settings of one run; the CLI maps its flags onto this."""

    configs: tuple[str, ...]
    """Model names from bench.models.MODELS, run one after the other."""
    scenarios: tuple[str, ...] = SCENARIOS
    """Which of SCENARIOS to run."""
    device: str = "cpu"
    """Where peers and the local reference compute: cpu or cuda."""
    dtype: str = "float32"
    """Compute dtype of the peers and of the local reference."""
    repeats: int = 5
    """Repeated runs of each measurement (after one warm-up run)."""
    peer_counts: tuple[int, ...] = (1, 2, 3)
    """Splits of each model's blocks into this many peers on loopback."""
    decode_steps: int = 64
    """Greedy steps per decode run (batch 1)."""
    decode_prompt: int = 16
    """Prompt tokens before the timed decode steps."""
    prefill_lengths: tuple[int, ...] = (128, 1024)
    """Prompt lengths of the prefill scenario."""
    train_batch: int = 4
    """Sequences per forward+backward."""
    train_seq: int = 256
    """Tokens per sequence of forward+backward."""
    concurrency_clients: tuple[int, ...] = (1, 2, 4, 8, 16)
    """Numbers of clients generating at the same time against the same peers."""
    concurrency_steps: int = 32
    """Greedy steps per client in the concurrency scenario."""
    concurrency_one_peer: bool = True
    """Also run the concurrency scenario against one peer serving every block: what it measures there is
    batching itself, where 3 peers and the client contend for the cores of one machine."""
    wan_delays_ms: tuple[int, ...] = (0, 10, 25, 50)
    """One-way delays of the wan scenario (each peer behind a delaying proxy)."""
    wan_steps: int = 16
    """Decode steps per run of the wan scenario."""
    wan_prefill: int = 128
    """Prompt tokens of the wan scenario's prefill."""
    speculative_delays_ms: tuple[int, ...] = (0, 25, 50)
    """One-way delays of the speculative scenario."""
    speculative_tokens: int = 64
    """New tokens per generation of the speculative scenario."""
    prompt_lookup_tokens: int = 8
    """prompt_lookup_num_tokens of the speculative scenario (drafts per round trip at most)."""
    wire_calls: int = 100
    """Echo calls per payload and transport in one repeat of the wire scenario."""
    train_swarm_steps: int = 30
    """Optimizer steps of each training run of the train_swarm scenario (its pipelining runs take half)."""
    offload_fractions: tuple[float, ...] = (0.25, 0.5, 0.75)
    """Shares of the span's blocks the offload scenario's budgets hold (the two streaming slots included)."""
    moe_train_steps: int = 300
    """Training steps of the moe scenario's model before it is measured (0: random weights)."""
    moe_steps: int = 192
    """Decode steps of the moe scenario, after a 64-token prefill."""
    peer_threads: int = 1
    """torch threads of each peer process (`--num-threads`); the CLI defaults it to the reference's."""
    peer_omp_passive: bool = True
    """Start peers with OMP_WAIT_POLICY=PASSIVE: idle OpenMP threads sleep instead of spinning, so peers
    sharing the cores do not steal them from the one computing (without it, 3 peers x 2 threads on 2 cores
    lose 3x aggregate throughput with concurrent clients)."""
    reference_threads: int = 0
    """torch threads of this process (the local reference and the client); 0 keeps torch's default."""
    memory_overhead_mib: float = 450.0
    """Fixed runtime overhead a peer may hold beyond its weights and KV cache (Python, torch, gRPC, DHT client)."""
    quick: bool = False

    def __post_init__(self) -> None:
        if not self.configs:
            raise ValueError("configs is empty; name at least one model, e.g. --configs tiny")
        unknown = sorted(set(self.scenarios) - set(SCENARIOS))
        if unknown or not self.scenarios:
            raise ValueError(f"scenarios must be some of {','.join(SCENARIOS)}, got {','.join(self.scenarios)!r}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        for name in (
            "repeats",
            "decode_steps",
            "decode_prompt",
            "train_batch",
            "train_seq",
            "concurrency_steps",
            "wire_calls",
            "train_swarm_steps",
            "peer_threads",
            "speculative_tokens",
            "prompt_lookup_tokens",
            "moe_steps",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("peer_counts", "prefill_lengths", "concurrency_clients"):
            values = getattr(self, name)
            if not values or min(values) < 1:
                raise ValueError(f"{name} must be positive integers, got {values}")
        if not self.offload_fractions or not all(0 < f < 1 for f in self.offload_fractions):
            raise ValueError(f"offload_fractions must be shares between 0 and 1, got {self.offload_fractions}")
        if self.moe_train_steps < 0:
            raise ValueError(f"moe_train_steps must be >= 0, got {self.moe_train_steps}")
        if self.reference_threads < 0:
            raise ValueError(f"reference_threads must be >= 0, got {self.reference_threads}")

    @property
    def needs_swarm(self) -> bool:
        return any(s in self.scenarios for s in MODEL_SCENARIOS)

    def replace(self, **changes) -> Plan:
        return dataclasses.replace(self, **changes)


def preset(*, quick: bool, device: str) -> Plan:
    """The quick (~2 min on 2 cores) or full (~15 min, and ~18 more for train_swarm) preset for `device`."""
    gpu = device == "cuda"
    if quick:
        return Plan(
            configs=("default",),
            scenarios=QUICK_SCENARIOS,
            device=device,
            dtype="bfloat16" if gpu else "float32",
            repeats=3,
            train_swarm_steps=12,
            peer_counts=(3,),
            prefill_lengths=(128,),
            train_batch=2,
            train_seq=128,
            concurrency_clients=(1, 2, 4, 8),
            concurrency_steps=8,
            concurrency_one_peer=False,
            wire_calls=30,
            quick=True,
            memory_overhead_mib=1024.0 if gpu else 450.0,
        )
    return Plan(
        configs=("default", "small", "tiny", "large") if gpu else ("default", "small", "tiny"),
        device=device,
        dtype="bfloat16" if gpu else "float32",
        repeats=4,
        concurrency_steps=16,
        wire_calls=40,
        memory_overhead_mib=1024.0 if gpu else 450.0,
    )


def cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
