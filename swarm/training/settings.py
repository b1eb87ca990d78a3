"""Settings of training that the CLI reads before anything heavy is imported: the recipe's flags, group timing.

`swarmlm peer --train` and `swarmlm train` check their flags against these first, so that a wrong flag is
answered at once, not after loading torch and hivemind. The recipe's flags default to None, "not given": a process
then adopts the run's setting, or RunRecipe's default when it starts the run (swarm/training/recipe.py).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from protocol.vocab import choices
from swarm.training.recipe import AVERAGING_COMPRESSIONS, OPTIMIZERS, LRSchedule, RunRecipe


@dataclass(frozen=True, kw_only=True)
class AveragingSettings:
    """Timing of a group's rounds; the defaults suit volunteers on the internet, tests shorten them."""

    matchmaking_time_s: float = 15.0
    """How long a round waits for members to gather before it averages."""
    averaging_timeout_s: float = 60.0
    """A round not done in this long fails; each member then updates with its own gradients."""
    load_state_timeout_s: float = 60.0
    """How long a joining member tries to copy a member's state before giving up."""
    progress_period_s: float = 0.5
    """How often a member publishes its progress; a record not renewed for 4 periods is gone."""

    def __post_init__(self) -> None:
        for name in ("matchmaking_time_s", "averaging_timeout_s", "load_state_timeout_s", "progress_period_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.averaging_timeout_s <= self.matchmaking_time_s:
            raise ValueError(
                f"averaging_timeout_s ({self.averaging_timeout_s}) must exceed matchmaking_time_s "
                f"({self.matchmaking_time_s})"
            )


def add_averaging_arguments(t) -> None:
    """The flags of AveragingSettings, shared by `swarmlm peer --train` and `swarmlm train`."""
    t.add_argument(
        "--matchmaking-time-s",
        type=float,
        default=15.0,
        metavar="S",
        help="how long an averaging round gathers its group (default: 15)",
    )
    t.add_argument(
        "--averaging-timeout-s",
        type=float,
        default=60.0,
        metavar="S",
        help="a round not done in this long falls back to local gradients (default: 60)",
    )
    t.add_argument(
        "--load-state-timeout-s",
        type=float,
        default=60.0,
        metavar="S",
        help="how long a joining member tries to copy its group's state (default: 60)",
    )


def averaging_from_args(args: argparse.Namespace) -> AveragingSettings:
    return AveragingSettings(
        matchmaking_time_s=args.matchmaking_time_s,
        averaging_timeout_s=args.averaging_timeout_s,
        load_state_timeout_s=args.load_state_timeout_s,
    )


def add_recipe_arguments(t) -> None:
    """The flags of the run's recipe that `swarmlm peer --train` and `swarmlm train` share, each None unless given."""
    d = RunRecipe()

    def default(value) -> str:
        return f"(default: the run's; {value} when starting one)"

    t.add_argument("--optimizer", choices=OPTIMIZERS, help=f"the run's optimizer {default(d.optimizer)}")
    t.add_argument("--lr", type=float, help=f"learning rate after warmup {default(f'{d.lr:g}')}")
    t.add_argument(
        "--weight-decay",
        type=float,
        metavar="WD",
        help=f"weight decay, not on norms, biases and embeddings {default(f'{d.weight_decay:g}')}",
    )
    t.add_argument(
        "--warmup-steps",
        type=int,
        metavar="N",
        help=f"updates over which the learning rate rises from 0 {default(d.warmup_steps)}",
    )
    t.add_argument(
        "--lr-schedule",
        choices=choices(LRSchedule),
        help=f"after warmup: constant, or cosine down to 0 at --total-steps {default(d.lr_schedule)}",
    )
    t.add_argument(
        "--total-steps",
        type=int,
        metavar="N",
        help=f"updates the run is planned for; cosine needs it {default(d.total_steps)}",
    )
    t.add_argument(
        "--max-grad-norm",
        type=float,
        metavar="NORM",
        help=f"clip each update to this global gradient norm, 0 for none {default(f'{d.max_grad_norm:g}')}",
    )
    t.add_argument(
        "--averaging-compression",
        choices=AVERAGING_COMPRESSIONS,
        help=f"how rounds send gradients: none (float64, exact), float16 (a quarter of the bytes, lossy) or int8 "
        f"(an eighth, lossy, with error feedback) "
        f"{default(d.averaging_compression)}",
    )
    t.add_argument(
        "--local-steps",
        type=int,
        metavar="H",
        help=f"updates between rounds: 1 averages every update's gradients; H > 1 steps on local gradients and "
        f"averages the weights' change every H updates with an outer Nesterov step (DiLoCo) {default(d.local_steps)}",
    )
    t.add_argument(
        "--outer-lr",
        type=float,
        metavar="LR",
        help=f"the outer step's learning rate with --local-steps above 1 {default(f'{d.outer_lr:g}')}",
    )
    t.add_argument(
        "--outer-momentum",
        type=float,
        metavar="M",
        help=f"the outer step's Nesterov momentum with --local-steps above 1 {default(f'{d.outer_momentum:g}')}",
    )
    t.add_argument(
        "--sync-overlap",
        type=int,
        metavar="N",
        help=f"with --local-steps above 1, inner steps taken while a sync's round runs in the background (Streaming "
        f"DiLoCo); its outer step lands after the N-th, and nobody waits for it. 0 waits {default(d.sync_overlap)}",
    )


def recipe_arguments(args: argparse.Namespace) -> dict[str, Any]:
    """The flags of `add_recipe_arguments` as config fields (None: not given)."""
    names = (
        "optimizer",
        "lr",
        "weight_decay",
        "warmup_steps",
        "lr_schedule",
        "total_steps",
        "max_grad_norm",
        "averaging_compression",
        "local_steps",
        "outer_lr",
        "outer_momentum",
        "sync_overlap",
    )
    return {name: getattr(args, name) for name in names}
