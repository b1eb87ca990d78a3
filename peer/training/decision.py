"""A trainer's decision on an update, as its record announces it: the rounds it applies and their clipping factor.

A trainer stores its decision before the first Apply of an update (client/training/trainer.py). Its Apply calls go
to every stage at once, so a trainer that dies between two of them leaves some stages one update ahead of the
others. A member whose Apply never came, and whose update's trainers are all gone, applies its round as decided
instead of dropping it (peer/training/span.py). Only the decision of one of the round's own trainers counts (the
records are signed), for the member's update and the round it averaged.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from protocol import swarmlm_pb2 as pb
from protocol.records import TrainingProgress, round_tag


@dataclass(frozen=True)
class Decision:
    trainer: str
    epoch: int
    round_id: str
    clip_scale: float


def decision_for(records: Mapping[str, TrainingProgress], status: pb.RoundStatus) -> Decision | None:
    """The decision on the round of `status` (an AVERAGED one) in the records of that round's trainers, or None."""
    if status.state != pb.RoundStatus.AVERAGED or not status.round_id:
        return None
    tag = round_tag(status.round_id)
    for trainer in sorted(status.trainers):  # with several, each decided the same: the first one found stands
        record = records.get(trainer)
        if record is not None and record.epoch == status.epoch and tag in record.decided:
            return Decision(trainer, status.epoch, status.round_id, record.clip_scale)
    return None
