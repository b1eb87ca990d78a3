"""The client library: use a swarm-served model like a local transformers model.

- model: DistributedModelForCausalLM / AutoDistributedModelForCausalLM (local embeddings, norm, head)
- sequence: the remote blocks, routing, retries, forward/backward with autograd
- session: inference sessions with server-side KV caches and failover by replay
- routing: route planning (pure functions)
- transport: gRPC channels and calls; loop: the background event loop
- config: ClientConfig
- training: SwarmTrainer, pipelined synchronous training with the peers of a run; local_training: its reference
- data: token batches from text files (default: Shakespeare), shuffled, resumable, prefetched
- train_cli, export: `swarmlm train`, `swarmlm export`
- demo: `swarmlm demo`
"""

from client.config import ClientConfig
from client.model import AutoDistributedModelForCausalLM, ClientSession, DistributedModelForCausalLM
from client.routing import RouteHop, plan_forward_route, plan_inference_route
from client.session import InferenceSession
from client.training import StepResult, SwarmTrainer, TrainConfig

__all__ = [
    "AutoDistributedModelForCausalLM",
    "ClientConfig",
    "ClientSession",
    "DistributedModelForCausalLM",
    "InferenceSession",
    "RouteHop",
    "StepResult",
    "SwarmTrainer",
    "TrainConfig",
    "plan_forward_route",
    "plan_inference_route",
]
