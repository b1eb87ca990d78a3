"""Spot checks: a random sample of forward and backward hops is recomputed on other peers, to catch wrong results.

client/checks.py catches answers of the wrong kind, shape or dtype, or with NaN; a peer that computes a wrong
but plausible tensor passes those checks. So, with probability `verify_fraction`, a hop (blocks [start, end) on
peer A, its answer checked) is recomputed on peers other than A:

1. a route over the same blocks that avoids A (one peer, or several whose spans cover the blocks). With none,
   the hop is counted as unverifiable and A's answer is used;
2. if the two answers agree within tolerance, A's answer is used, unchanged;
3. if not, a third route that avoids both breaks the tie. Whoever disagrees with the other two is outvoted, and
   the majority's answer is used. A side computed by several peers is never banned, because nothing says which
   of them lied;
4. an outvoted peer is banned (for `WRONG_RESULT_BAN_S`) only when a fourth route, avoiding all three, confirms
   the majority: three against one. Two colluding liars drawn to check an honest answer can outvote it, but
   never get it banned. With no fourth route, the outvoted peer is set aside (`SpotCheckStats.outvoted`; an
   inference session routes around it) but not banned; if the fourth sides with it, two against two, nobody is;
5. with no third route, or three answers that do not agree two against one, nobody is banned (nobody can be
   told a liar). The mismatch is logged as unresolved, and A's answer is kept, as it would be without the
   check. Raising instead would ban A through the retry path, which is as likely to punish the honest one.

Every verdict is logged as a WARNING naming all the peers and the differences.

Tolerance, per element: a and b agree when every  |a_i - b_i| <= rtol * (m_i + median of m over i's row),  where
m = max(|a|, |b|) and a row is the last dimension (one token's hidden state), with rtol by the dtype the hops
compute in (the loosest of the hops and of the tensors): float32 1e-4, float16 1e-2, bfloat16 5e-2. Honest
peers differ in the order of their sums (threads, kernels, devices), an error that grows with the values summed:
the row's median magnitude bounds it for small elements. A bound relative to the tensor's largest magnitude would
let one outlier feature (hidden states have some 100x the rest) hide lies on every other element. There is no
absolute term, because gradients can be tiny everywhere and any absolute term would let them all pass. A lie
smaller than this goes unseen by design; the check is there to find peers that compute wrong, not to certify bits.

Checkers are drawn uniformly among the peers that serve the blocks, not by announced throughput: a liar that
announces a huge figure would otherwise be drawn to check itself, or its accomplice.

Inference steps are checked by client/inference_checks.py, with this vote. Not checked: training runs (a stage's
peers update their weights, so two of them agree only at the same epoch, and a backward adds to the stage's
gradients).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import torch

from client.routing import RouteHop

logger = logging.getLogger(__name__)

WRONG_RESULT_BAN_S = 3600.0
"""How long a peer outvoted three to one stays banned: a wrong result is no accident of the network."""

RTOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}
"""Relative tolerance by compute dtype (see the module docstring); other dtypes get float32's."""


def rtol_for(*dtypes: torch.dtype) -> float:
    """The loosest tolerance of `dtypes`."""
    return max(RTOL.get(dtype, RTOL[torch.float32]) for dtype in dtypes)


def difference(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """(max|a - b|, max(max|a|, max|b|)), computed in float32."""
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).abs().max()), float(torch.maximum(a.abs().max(), b.abs().max()))


def agree(a: torch.Tensor, b: torch.Tensor, rtol: float) -> bool:
    """Whether `a` and `b` are the same result, element by element, within `rtol` (see the module docstring)."""
    return a.shape == b.shape and bool(_within(a, b, rtol).all())


def first_disagreement(a: torch.Tensor, b: torch.Tensor, rtol: float) -> int | None:
    """The first position (dim 1 of [batch, positions, hidden]) at which `a` and `b` differ as `agree` judges them;
    None if they agree everywhere.

    Raises:
        ValueError: their shapes differ.
    """
    if a.shape != b.shape or a.ndim != 3:
        raise ValueError(f"compares two [batch, positions, hidden] tensors, got {list(a.shape)} and {list(b.shape)}")
    wrong = (~_within(a, b, rtol)).any(dim=-1).any(dim=0).nonzero()
    return int(wrong[0, 0]) if len(wrong) else None


def _within(a: torch.Tensor, b: torch.Tensor, rtol: float) -> torch.Tensor:
    """Per element, whether `a` and `b` agree within `rtol` (same shapes)."""
    a, b = a.detach().float(), b.detach().float()
    magnitude = torch.maximum(a.abs(), b.abs())
    # the row's median, not its mean: one outlier feature would set the mean for the whole row
    floor = magnitude.median(dim=-1, keepdim=True).values if magnitude.ndim and magnitude.shape[-1] else magnitude
    return (a - b).abs() <= rtol * (magnitude + floor)


@dataclass
class Computed:
    """One route's answer for a span: the tensor, who computed it, and in which dtype."""

    value: torch.Tensor
    peers: tuple[str, ...]
    dtypes: tuple[torch.dtype, ...] = (torch.float32,)
    """The dtype each of its hops computes in."""
    records: list = field(default_factory=list)
    """For a forward: what each hop of the route was sent (client/sequence.py HopRecord), for the backward."""


Recompute = Callable[[frozenset[str]], Awaitable["Computed | None"]]
"""Computes the span again avoiding the given peers; None when no such route exists or one of its peers failed."""
CallForward = Callable[[RouteHop, torch.Tensor], Awaitable["torch.Tensor | None"]]
"""One hop's forward of some hidden states; None if its peer failed."""
CallBackward = Callable[[RouteHop, torch.Tensor, torch.Tensor], Awaitable["torch.Tensor | None"]]
"""One hop's gradient w.r.t. its inputs, given the inputs and the gradient w.r.t. its output; None if it failed."""


@dataclass
class SpotCheckStats:
    """What the spot checks of one client found."""

    verified: int = 0
    """Hops recomputed on another peer and compared."""
    mismatches: int = 0
    """Of those, hops whose two answers disagreed."""
    unverifiable: int = 0
    """Hops drawn for a check that no other peer could recompute."""
    unresolved: int = 0
    """Mismatches without a two-against-one majority, or two against two after a fourth route: nobody was banned."""
    outvoted: list[str] = field(default_factory=list)
    """Peers outvoted two to one that no fourth route could confirm as wrong, in order: set aside, not banned."""
    caught: list[str] = field(default_factory=list)
    """Peers banned for a wrong result (outvoted three to one), in order."""


class SpotChecker:
    """Draws the hops to check (`draw`) and decides between their answers (`check`).

    Args:
        fraction: probability that a hop is checked (0 turns checks off).
        ban: bans a peer for a wrong result for at least the given seconds; returns the ban's length.
        rng: the draws and the routes of the checks (seeded, a run's checks repeat).
    """

    def __init__(self, fraction: float, ban: Callable[[str, float], float], rng: random.Random | None = None):
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"verify_fraction must lie in [0, 1], got {fraction}")
        self.fraction, self.ban = fraction, ban
        self.rng = rng or random.Random()
        self.stats = SpotCheckStats()

    def draw(self) -> bool:
        """Whether to check the hop at hand."""
        return self.fraction > 0 and self.rng.random() < self.fraction

    async def check(self, what: str, span: tuple[int, int], first: Computed, recompute: Recompute) -> Computed:
        """The answer to use for `span`, given `first` (the route's own) and a way to compute it elsewhere.

        Returns `first` itself unless two other routes agree against it.
        """
        second = await recompute(frozenset(first.peers))
        if second is None:
            self.stats.unverifiable += 1
            return first
        self.stats.verified += 1
        rtol = rtol_for(*first.dtypes, *second.dtypes, first.value.dtype, second.value.dtype)
        if agree(first.value, second.value, rtol):
            return first
        self.stats.mismatches += 1
        blocks = f"{what} of blocks {span[0]}:{span[1]}"
        diff_12 = difference(first.value, second.value)[0]
        third = await recompute(frozenset(first.peers + second.peers))
        if third is None:
            self.stats.unresolved += 1
            logger.warning(
                "spot check: %s differs between %s and %s (max |difference| %.3g, rtol %g) and no "
                "third peer serves them; nobody banned, %s's answer kept",
                blocks,
                _who(first),
                _who(second),
                diff_12,
                rtol,
                _who(first),
            )
            return first
        rtol = max(rtol, rtol_for(*third.dtypes, third.value.dtype))
        first_third, second_third = agree(first.value, third.value, rtol), agree(second.value, third.value, rtol)
        diffs = (
            f"max |difference| {diff_12:.3g} between {_who(first)} and {_who(second)}, "
            f"{difference(first.value, third.value)[0]:.3g} between {_who(first)} and {_who(third)}, "
            f"{difference(second.value, third.value)[0]:.3g} between {_who(second)} and {_who(third)}"
        )
        if second_third != first_third:  # two against one
            outvoted, majority = (first, second) if second_third else (second, first)
            if await self._confirm(outvoted, majority, third, blocks, diffs, rtol, recompute):
                return majority
            return first  # two against two: as unresolved
        self.stats.unresolved += 1
        logger.warning(
            "spot check: %s, no two-against-one majority (%s; rtol %g); nobody banned, %s's answer kept",
            blocks,
            diffs,
            rtol,
            _who(first),
        )
        return first

    async def _confirm(
        self, outvoted: Computed, majority: Computed, third: Computed, blocks: str, diffs: str, rtol: float, recompute
    ) -> bool:
        """`outvoted` disagreed with `majority` and `third`, which agree: ban its peer if a fourth route confirms
        them (three against one), else set it aside. False if the fourth sides with `outvoted`: two against two,
        nobody banned and the first answer kept."""
        if len(set(outvoted.peers)) != 1:
            logger.warning(
                "spot check: %s, a route of several peers (%s) was outvoted (%s); nobody banned, since "
                "it is not known which of them lied",
                blocks,
                _who(outvoted),
                diffs,
            )
            return True
        peer = outvoted.peers[0]
        fourth = await recompute(frozenset(outvoted.peers + majority.peers + third.peers))
        if fourth is not None:
            rtol = max(rtol, rtol_for(*fourth.dtypes, fourth.value.dtype))
        if fourth is not None and agree(fourth.value, majority.value, rtol):
            length_s = self.ban(peer, WRONG_RESULT_BAN_S)
            self.stats.caught.append(peer)
            logger.warning(
                "spot check: peer %s computed a wrong %s, outvoted three to one (%s; %s agrees with the "
                "majority); banned for %.0fs",
                peer,
                blocks,
                diffs,
                _who(fourth),
                length_s,
            )
            return True
        if fourth is None or not agree(fourth.value, outvoted.value, rtol):
            self.stats.outvoted.append(peer)
            logger.warning(
                "spot check: peer %s was outvoted two to one on %s (%s) and %s; the majority's answer used, "
                "%s set aside but not banned (two colluding checkers could outvote an honest peer)",
                peer,
                blocks,
                diffs,
                "no fourth peer serves them" if fourth is None else f"a fourth, {_who(fourth)}, agrees with nobody",
                peer,
            )
            return True
        self.stats.unresolved += 1
        logger.warning(
            "spot check: %s, two against two: %s outvoted by %s and %s, but %s agrees with it (%s); "
            "nobody banned, the route's own answer kept",
            blocks,
            peer,
            _who(majority),
            _who(third),
            _who(fourth),
            diffs,
        )
        return False


def _who(computed: Computed) -> str:
    return "+".join(computed.peers)


async def forward_on(
    route: list[RouteHop], inputs: torch.Tensor, forward: CallForward
) -> tuple[torch.Tensor, list[tuple[RouteHop, torch.Tensor]]] | None:
    """`inputs` through `route`: the output and what each hop was sent; None if a hop failed."""
    hidden, sent = inputs, []
    for hop in route:
        sent.append((hop, hidden))
        hidden = await forward(hop, hidden)
        if hidden is None:
            return None
    return hidden, sent


async def backward_on(
    route: list[RouteHop], inputs: torch.Tensor, grad: torch.Tensor, forward: CallForward, backward: CallBackward
) -> torch.Tensor | None:
    """The gradient w.r.t. `inputs` of `route`, given `grad` w.r.t. its output; None if a hop failed.

    A route of several hops first runs the forward of all but its last, for the inputs of each.
    """
    done = await forward_on(route[:-1], inputs, forward)
    if done is None:
        return None
    hidden, sent = done
    for hop, hop_inputs in reversed([*sent, (route[-1], hidden)]):
        grad = await backward(hop, hop_inputs, grad)
        if grad is None:
            return None
    return grad
