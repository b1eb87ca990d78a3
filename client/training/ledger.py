"""Where each micro-batch of a trainer's step went, per stage: the record behind exactly-once training.

A stage peer adds a micro-batch (trainer, index) once, so a backward whose answer was lost is sent again to the
same peer, never to another one while the first may still hold it. Only a peer declared lost is given up on: it is
fenced for the update, every micro-batch it held is sent again to another member, and the commit leaves it out,
so that whatever it holds is dropped when it comes back. The ledger is plain data; the trainer does the calls.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from client.sequence import TakenBackward

Span = tuple[int, int]


@dataclass
class StageLedger:
    """One stage: member -> index -> what it was sent, and the members fenced for this update."""

    held: dict[str, dict[int, TakenBackward]] = field(default_factory=dict)
    samples: dict[int, int] = field(default_factory=dict)  # index -> its sequences
    fenced: set[str] = field(default_factory=set)


class Ledger:
    """A step's micro-batches at every stage: who holds each, once."""

    def __init__(self, spans: Iterable[Span]):
        self.stages: dict[Span, StageLedger] = {span: StageLedger() for span in spans}

    def record(self, span: Span, peer_id: str, index: int, samples: int, taken: TakenBackward) -> bool:
        """`peer_id` answered micro-batch `index`'s backward; False if that peer was fenced meanwhile (the answer is
        no good: send it elsewhere)."""
        stage = self.stages[span]
        if peer_id in stage.fenced:
            return False
        for other, held in stage.held.items():
            if other != peer_id and index in held:
                raise AssertionError(f"micro-batch {index} of stage {span} is held by {other} and {peer_id}")
        stage.held.setdefault(peer_id, {})[index] = taken
        stage.samples[index] = samples
        return True

    def fence(self, span: Span, peer_id: str) -> list[tuple[int, TakenBackward]]:
        """Leave `peer_id` out of this update; returns the micro-batches it held, to send to other members."""
        stage = self.stages[span]
        stage.fenced.add(peer_id)
        return sorted(stage.held.pop(peer_id, {}).items(), key=lambda item: item[0])

    def fenced(self) -> set[str]:
        return {peer for stage in self.stages.values() for peer in stage.fenced}

    def holdings(self, span: Span) -> dict[str, list[int]]:
        """Member -> the indices it holds, sorted."""
        return {peer: sorted(held) for peer, held in self.stages[span].held.items() if held}

    def samples_of(self, span: Span, indices: Iterable[int]) -> int:
        return sum(self.stages[span].samples[i] for i in indices)

    def complete(self, span: Span, count: int) -> bool:
        """Whether every index in [0, count) is held by exactly one member of the stage."""
        held = [i for member in self.stages[span].held.values() for i in member]
        return sorted(held) == list(range(count))
