"""Settings of training that the CLI reads before anything heavy is imported: optimizer names, group timing.

`swarmlm peer --train` and `swarmlm train` check their flags against these first, so that a wrong flag is
answered at once, not after loading torch and hivemind.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

OPTIMIZERS = ("adamw", "adam", "sgd")


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
