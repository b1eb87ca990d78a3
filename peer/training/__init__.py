"""A training peer's part in a run (`swarmlm peer ... --train`).

- span: SpanTraining, the span's trainable tensors, float32 masters and optimizer, and the handlers of the run's
  calls (backward, commit, apply)
- accumulators: the gradients held for the next update, one sum per trainer, each micro-batch added once
- commits: the trainers' commits of an update and the round they define (plain data)
- follow: Follower, keeping a member in step with its group and trainers between calls (catching up, finishing or
  dropping an update whose trainers are gone)
- decision: which trainer's record decides a member's averaged round (plain data)
- syncs: Syncs, a member's outer optimizer and syncs with local steps (DiLoCo), waited for or overlapped

May import protocol, swarm and the rest of peer.
"""

from protocol.lazy import lazy_exports

__all__ = ["SpanTraining"]

__getattr__ = lazy_exports("peer.training", {"SpanTraining": ("peer.training.span", "SpanTraining")})
