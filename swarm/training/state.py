"""Copying a group's state only when a majority of the group vouches for it.

A member that joins, or that fell behind (declared lost, or its round failed), copies the group's parameters and
optimizer statistics (float32 masters). Every member announces, in its signed progress record, the digest of its
state after its last update (TrainingProgress.param_digest). A copy is accepted only when its digest equals the
(epoch, digest) that a strict majority of the other members announce, and only from members that announced it; a
donor whose state does not match is skipped and the next one tried. Donors are chosen here, from the signed
records, not by hivemind's load_state_from_peers, which takes whoever announces the highest priority.

Once a stage member has applied an update, it decides by what it knows first hand (`deciding`): the records of the
members it last averaged with, less those behind the update that the trainers of that round announce they have
applied (a trainer announces an update only once every stage applied it, so a member behind it is behind for
certain). Otherwise two of three members that sat the same update out would outvote, with their equal stale states,
the one member that took part, and neither would ever catch up. A stranger took part in no round with the member,
and its trainer records do not count. When none of those members is left, every record counts again.

What this bounds: a stranger (or a minority) cannot make a member take its state, or move the epoch a member catches
up to. Members that have no state to vouch for (an empty digest: joining, or after a failed round) do not vote, so
that joiners arriving together do not block each other. Sybils that outnumber the honest members are not bounded
here: in a private swarm, only key holders can publish records at all.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import Counter
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

import torch

from protocol.errors import DHTUnavailableError, StateDownloadError
from protocol.records import TrainingProgress
from swarm.training.rounds import RoundAverager

logger = logging.getLogger(__name__)

_STREAM_OVERHEAD_BYTES = 1 << 16  # per tensor: serialization headers, and the metadata


def state_digest(tensors: Sequence[torch.Tensor]) -> str:
    """sha256 (hex) of the tensors' dtypes, shapes and bytes, in order: what TrainingProgress.param_digest holds."""
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach().to("cpu").contiguous()
        h.update(f"{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def majority_claim(members: Mapping[str, TrainingProgress]) -> tuple[int, str] | None:
    """The (epoch, digest) that a strict majority of `members` announce, or None.

    `members`: the group's other members (leave out the caller: its own state is the one in question). Members
    with an empty digest, and those that left (they serve no state), vouch for nothing and do not vote.
    """
    claims = Counter((p.epoch, p.param_digest) for p in members.values() if p.param_digest and not p.left)
    if not claims:
        return None
    claim, votes = claims.most_common(1)[0]
    return claim if 2 * votes > sum(claims.values()) else None


def applied_by_trainers(trainers: Mapping[str, TrainingProgress]) -> int:
    """The latest update that a strict majority of `trainers` (the live ones) announce they have applied (their
    records' epoch), 0 when none is live."""
    epochs = sorted((p.epoch for p in trainers.values() if not p.left), reverse=True)
    return epochs[len(epochs) // 2] if epochs else 0


def deciding(
    members: Mapping[str, TrainingProgress], me: str, *, comembers: Collection[str], applied: int
) -> dict[str, TrainingProgress]:
    """The records a member decides by, out of every member's `members` (the caller's own is kept: it tells a whole
    read, `others_gone`).

    Those of `comembers` (the members of the last round the caller took part in) at or past `applied` (the update
    that the trainers of that round announce they have applied, applied_by_trainers); every member's when that
    leaves none of the others, or `applied` is 0 (unknown).
    """
    trusted = {peer: p for peer, p in members.items() if peer in comembers and peer != me and p.epoch >= applied}
    if applied <= 0 or not trusted:
        return dict(members)
    return {**trusted, **({me: members[me]} if me in members else {})}


def others_gone(members: Mapping[str, TrainingProgress], me: str) -> bool:
    """Whether `members` (a read of the group's records) shows `me` and no other live member: a read that holds
    our own record is whole, so every member that could vouch for a state is gone (their records lapsed, or say
    they left)."""
    return me in members and all(p.left for peer, p in members.items() if peer != me)


def donor_order(members: Mapping[str, TrainingProgress], claim: tuple[int, str], me: str) -> list[str]:
    """The members that announced `claim`, in the order a member tries them: by peer id, starting after `me`, so
    that joiners arriving together spread over the donors."""
    donors = sorted(
        peer for peer, p in members.items() if (p.epoch, p.param_digest) == claim and peer != me and not p.left
    )
    later = [peer for peer in donors if peer > me]
    return later + [peer for peer in donors if peer < me]


@dataclass(frozen=True, kw_only=True)
class VerifiedState:
    """A state whose digest a majority of the group announced."""

    epoch: int
    """The update it follows (the majority's epoch)."""
    digest: str
    tensors: list[torch.Tensor]
    """In the order, shapes and dtypes of the caller's `like`."""
    donor: str
    """The member it was downloaded from."""


def load_verified_state(
    averager: RoundAverager,
    read_members: Callable[[], Mapping[str, TrainingProgress]],
    *,
    like: Sequence[torch.Tensor],
    timeout_s: float,
    retry_s: float = 1.0,
    digest_of: Callable[[Sequence[torch.Tensor]], str] = state_digest,
) -> VerifiedState:
    """Download the state that a strict majority of the group vouches for, from a member that vouches for it.

    Args:
        averager: this member's averager (downloads go through its process).
        read_members: peer id -> verified progress of the group's members (GroupProgress.members); read again after
            each pass over the donors, since the group moves on while this member catches up.
        like: this member's own state tensors, whose shapes and dtypes a download must have.
        timeout_s: give up after this long.
        retry_s: pause between passes.
        digest_of: the digest members announce of a state (default: of all of it; a run with local steps vouches
            for the part its members share, swarm/training/outer.py).

    Raises:
        StateDownloadError: no majority claim, or no donor sent a state with the claimed digest, within `timeout_s`;
            the message names every donor tried and why it was refused. At once when a read that holds this
            member's own record holds no other live member: nobody is left to vouch for a state.
    """
    me = averager.member_id
    schema = [(t.shape, t.dtype) for t in like]
    max_bytes = sum(t.numel() * t.element_size() + _STREAM_OVERHEAD_BYTES for t in like)
    deadline = time.monotonic() + timeout_s
    tried: dict[str, str] = {}  # donor -> why its state was refused
    claim = None
    while True:
        try:
            read = read_members()
        except DHTUnavailableError as exc:  # this node's DHT under load: the next pass reads again
            logger.warning("could not read the members of %s: %s", averager.prefix, exc)
            read = {}
        members = {peer: p for peer, p in read.items() if peer != me}
        if others_gone(read, me):  # waiting out the timeout would not bring one back
            raise StateDownloadError(
                f"no other member of group {averager.prefix} is left to copy a state from"
                + (f"; donors tried: {_tried(tried)}" if tried else "")
            )
        claim = majority_claim(members)
        for donor in donor_order(members, claim, me) if claim is not None else []:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                tensors = averager.download_state(donor, timeout_s=left, max_bytes=max_bytes)
            except Exception as exc:
                tried[donor] = f"download failed: {exc}"
                logger.warning("could not download the state of %s: %s", donor, exc)
                continue
            if [(t.shape, t.dtype) for t in tensors] != schema:
                tried[donor] = "a state of other shapes or dtypes"
                logger.warning("refused the state of %s: %s", donor, tried[donor])
                continue
            got = digest_of(tensors)  # after the schema check: digest_of may take the state apart
            if got != claim[1]:
                tried[donor] = f"digest {got[:12]} is not the majority's {claim[1][:12]}"
            else:
                logger.info("copied the state of epoch %d (digest %s) from %s", claim[0], got[:12], donor)
                return VerifiedState(epoch=claim[0], digest=got, tensors=list(tensors), donor=donor)
            logger.warning("refused the state of %s: %s", donor, tried[donor])
        if time.monotonic() + retry_s >= deadline:
            break
        time.sleep(retry_s)
    refused = _tried(tried) or "none"
    found = f"the majority announces epoch {claim[0]}" if claim is not None else "no strict majority announces a state"
    raise StateDownloadError(
        f"no verified state of group {averager.prefix} within {timeout_s:g}s: {found}; donors tried: {refused}. "
        f"Check that the group's members are reachable, or raise the load-state timeout"
    )


def _tried(tried: Mapping[str, str]) -> str:
    return "; ".join(f"{donor}: {why}" for donor, why in tried.items())
