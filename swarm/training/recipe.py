"""One run, one recipe: the settings that bind every member of a training run, and the numerics they fix.

- RunRecipe: optimizer, learning rate and its schedule, clipping, weight decay, batch, train mode, dtype policy;
  strict on the wire, with a digest and the list of differences a refusal names
- lr_at, clip_scale, global_norm: the schedule and clipping as pure functions, equal to transformers' and torch's
- publish_recipe, read_recipe(s), adopt_recipe: the run's recipe in the DHT, signed by each publisher;
  recipes_of_runs: those of every run a swarm's peers train (for `swarmlm status` and the monitor)

Pure Python up to the DHT functions, which import hivemind when called: the commands check their flags against
this module before anything heavy is imported.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from protocol.errors import DHTUnavailableError, InvalidRecordError, RecipeMismatchError
from protocol.records import CLOCK_SKEW_S, MAX_COUNT, MAX_RECORD_TTL_S
from protocol.vocab import StrEnum, TrainMode, choices

logger = logging.getLogger(__name__)

OPTIMIZERS = ("adamw", "adam", "sgd")
AVERAGING_COMPRESSIONS = ("none", "float16", "int8")  # swarm/training/rounds.py COMPRESSIONS has their codecs
MASTER_DTYPES = ("float32",)  # the dtype policy: master weights, accumulators and optimizer state
MAX_LORA_RANK = 1 << 16
RECIPE_TTL_S = MAX_RECORD_TTL_S - CLOCK_SKEW_S  # what the DHT still takes from a node with a skewed clock


class LRSchedule(StrEnum):
    """How the learning rate moves after its linear warmup from 0."""

    CONSTANT = "constant"
    """Flat at lr (transformers' get_constant_schedule_with_warmup)."""
    COSINE = "cosine"
    """A half cosine from lr down to 0 at total_steps (transformers' get_cosine_schedule_with_warmup); 0 after."""


# setting -> (kind, lower bound, whether the bound itself is allowed, upper bound or choices)
_SETTINGS: dict[str, tuple[str, float, bool, Any]] = {
    "optimizer": ("choice", 0, True, OPTIMIZERS),
    "lr": ("float", 0.0, False, math.inf),
    "weight_decay": ("float", 0.0, True, math.inf),
    "warmup_steps": ("int", 0, True, MAX_COUNT),
    "lr_schedule": ("choice", 0, True, choices(LRSchedule)),
    "total_steps": ("int", 0, True, MAX_COUNT),
    "max_grad_norm": ("float", 0.0, True, math.inf),
    "batch_size": ("int", 1, True, MAX_COUNT),
    "train_mode": ("choice", 0, True, choices(TrainMode)),
    "lora_rank": ("int", 1, True, MAX_LORA_RANK),
    "master_dtype": ("choice", 0, True, MASTER_DTYPES),
    "averaging_compression": ("choice", 0, True, AVERAGING_COMPRESSIONS),
    "local_steps": ("int", 1, True, MAX_COUNT),
    "outer_lr": ("float", 0.0, False, math.inf),
    "outer_momentum": ("float", 0.0, True, 0.999),
    "sync_overlap": ("int", 0, True, MAX_COUNT),
}
_ENUMS = {"lr_schedule": LRSchedule, "train_mode": TrainMode}


def check_setting(setting: str, value: Any, field: str | None = None, *, strict: bool = False) -> Any:
    """`value` for recipe setting `setting`, normalized (text of a vocabulary becomes its member, an int a float).

    Args:
        field: the name the error gives (a config's own field name); the setting's by default.
        strict: exact wire types (a float must be a float), as read from the DHT.

    Raises:
        ValueError: an unknown setting, or a value out of its range (the message names `field` and the value).
    """
    name = field or setting
    if setting not in _SETTINGS:
        raise ValueError(f"{name!r} is not a recipe setting; they are {', '.join(_SETTINGS)}")
    kind, low, low_allowed, high = _SETTINGS[setting]
    if kind == "choice":
        if not isinstance(value, str) or value not in high:
            raise ValueError(f"{name} must be one of {high}, got {value!r}")
        return _ENUMS[setting](value) if setting in _ENUMS else str(value)
    numeric = (int,) if kind == "int" else (float,) if strict else (int, float)
    if isinstance(value, bool) or not isinstance(value, numeric):
        raise ValueError(f"{name} must be {'an integer' if kind == 'int' else 'a number'}, got {value!r}")
    if kind == "float":
        value = float(value)
    in_range = (value >= low if low_allowed else value > low) and value <= high and not math.isinf(value)
    if not in_range:  # NaN fails every comparison
        bound = ("finite and " if kind == "float" else "") + (f">= {low}" if low_allowed else f"> {low}")
        raise ValueError(f"{name} must be {bound}{'' if math.isinf(high) else f' and <= {high}'}, got {value!r}")
    return value


def check_overrides(settings: Mapping[str, Any]) -> dict[str, Any]:
    """Given settings (a part of a recipe) each checked and normalized, and together where all the parts of a rule
    are given (a cosine schedule needs total_steps above warmup_steps).

    Raises:
        ValueError: naming the setting and its value.
    """
    checked = {name: check_setting(name, value) for name, value in settings.items()}
    _check_schedule(checked)
    _check_overlap(checked)
    return checked


def _check_overlap(settings: Mapping[str, Any]) -> None:
    overlap = settings.get("sync_overlap", 0)
    if not overlap or "local_steps" not in settings:
        return
    if overlap >= settings["local_steps"]:
        raise ValueError(
            f"sync_overlap must be below local_steps (a sync's outer step lands before the next sync begins), got "
            f"sync_overlap {overlap} and local_steps {settings['local_steps']}; pass --local-steps H with H above "
            f"--sync-overlap"
        )


def _check_schedule(settings: Mapping[str, Any]) -> None:
    if settings.get("lr_schedule") != LRSchedule.COSINE or "total_steps" not in settings:
        return
    total, warmup = settings["total_steps"], settings.get("warmup_steps", 0)
    if total <= warmup:
        raise ValueError(
            f"total_steps must exceed warmup_steps with lr_schedule cosine (it decays lr to 0 at total_steps), "
            f"got total_steps {total} and warmup_steps {warmup}; pass --total-steps N"
        )


@dataclass(frozen=True, kw_only=True)
class RunRecipe:
    """The settings every peer and trainer of a run shares; published once by whoever starts the run."""

    optimizer: str = "adamw"
    """adamw, adam or sgd: torch's, with torch's defaults for what is not here."""
    lr: float = 1e-4
    """The learning rate after warmup (its peak)."""
    weight_decay: float = 0.0
    """Decay of every weight but norms, biases and embeddings (decoupled for adamw, L2 for adam and sgd)."""
    warmup_steps: int = 0
    """Updates over which the learning rate rises linearly from 0 to lr."""
    lr_schedule: LRSchedule = LRSchedule.CONSTANT
    """After the warmup: constant, or cosine down to 0 at total_steps."""
    total_steps: int = 0
    """Updates the run is planned for (0: not set); a cosine schedule needs it."""
    max_grad_norm: float = 0.0
    """Clip each update's gradients to this norm, global over every stage and the trainers (0: no clipping)."""
    batch_size: int = 8
    """Samples per update, all trainers together."""
    train_mode: TrainMode = TrainMode.FULL
    """What the peers train: every weight of their spans, or LoRA adapters of their linear layers."""
    lora_rank: int = 8
    """Rank of the LoRA adapters (train_mode lora)."""
    master_dtype: str = "float32"
    """dtype of master weights, gradient accumulators and optimizer state, whatever the compute dtype."""
    averaging_compression: str = "none"
    """How rounds send gradients: "none" (float64, exact) or "float16" (scaled per part: a quarter of the bytes,
    lossy, the same on every member; swarm/training/allreduce.py)."""
    local_steps: int = 1
    """Updates between a group's rounds (DiLoCo's H; swarm/training/outer.py). 1: a round averages every update's
    gradients; H > 1: each member steps on its own gradients, and every H updates the group averages the change of
    its weights and applies the outer optimizer."""
    outer_lr: float = 0.7
    """The outer optimizer's learning rate (local_steps > 1; DiLoCo's default)."""
    outer_momentum: float = 0.9
    """The outer optimizer's Nesterov momentum (local_steps > 1; DiLoCo's default)."""
    sync_overlap: int = 0
    """Inner steps a sync runs behind (Streaming DiLoCo's overlap; local_steps > 1). 0: every member waits for the
    sync's round before its next update; N: the round runs in the background while the members take N more inner
    steps, and its outer step lands after the N-th, on top of them (swarm/training/outer.py)."""

    @property
    def lora_alpha(self) -> float:
        """LoRA's scale numerator: an adapter adds (alpha / rank) * B @ A to its layer (2 x rank, a common choice)."""
        return 2.0 * self.lora_rank

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            object.__setattr__(self, f.name, check_setting(f.name, getattr(self, f.name)))
        _check_schedule(self.to_wire())
        _check_overlap(self.to_wire())

    def to_wire(self) -> dict[str, Any]:
        """Every setting as plain msgpack-able values (vocabularies as text); sync_overlap only where it is set, so
        that a recipe without it reads (and digests) as it did before the setting existed."""
        wire = {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}
        if not wire["sync_overlap"]:
            del wire["sync_overlap"]
        return wire

    @classmethod
    def from_wire(cls, raw: Any) -> RunRecipe:
        """A recipe from its wire form: exactly its settings, each of its exact type and range.

        A setting this version does not know is refused, not dropped: a member cannot honour what it cannot read.

        Raises:
            InvalidRecordError: naming what is wrong.
        """
        names = [f.name for f in dataclasses.fields(cls)]
        if isinstance(raw, dict) and "sync_overlap" not in raw:  # what an unset overlap looks like (to_wire)
            raw = {**raw, "sync_overlap": 0}
        if not isinstance(raw, dict) or set(raw) != set(names):
            got = sorted(map(str, raw)) if isinstance(raw, dict) else type(raw).__name__
            raise InvalidRecordError(f"a recipe has exactly the settings {', '.join(names)}; got {got}")
        try:
            return cls(**{name: check_setting(name, raw[name], strict=True) for name in names})
        except ValueError as exc:
            raise InvalidRecordError(f"invalid recipe: {exc}") from None

    def digest(self) -> str:
        """sha256 (hex) of the canonical wire form: equal recipes, equal digests, on every member."""
        return hashlib.sha256(json.dumps(self.to_wire(), sort_keys=True).encode()).hexdigest()

    def differences(self, other: RunRecipe) -> list[str]:
        """Each setting where this recipe ("here") differs from `other` (the run's), with both values."""
        return [
            f"{name}: {_plain(mine)!r} here, {_plain(theirs)!r} in the run's recipe"
            for name, mine, theirs in (
                (f.name, getattr(self, f.name), getattr(other, f.name)) for f in dataclasses.fields(self)
            )
            if mine != theirs
        ]

    def describe(self) -> str:
        """One line for logs and `swarmlm status`."""
        schedule = f"{self.lr_schedule}" + (f" to {self.total_steps}" if self.total_steps else "")
        return (
            f"{self.optimizer} lr {self.lr:g} ({schedule}, warmup {self.warmup_steps}), weight decay "
            f"{self.weight_decay:g}, clip {self.max_grad_norm:g}, batch {self.batch_size}, {self.train_mode}"
            + (f" rank {self.lora_rank}" if self.train_mode == TrainMode.LORA else "")
            + f", {self.master_dtype} master"
            + (f", {self.averaging_compression} averaging" if self.averaging_compression != "none" else "")
            + (
                f", rounds every {self.local_steps} updates (outer lr {self.outer_lr:g}, momentum "
                f"{self.outer_momentum:g}"
                + (
                    f", each overlapping {self.sync_overlap} inner step{'s' * (self.sync_overlap > 1)}"
                    if self.sync_overlap
                    else ""
                )
                + ")"
                if self.local_steps > 1
                else ""
            )
        )


def _plain(value: Any) -> Any:
    return value.value if isinstance(value, StrEnum) else value


# --- the numerics of an update ---


def lr_at(recipe: RunRecipe, step: int) -> float:
    """The learning rate of update number `step` (0-based): what torch's LambdaLR gives with transformers' schedule
    after `step` scheduler steps, so the first update of a warmup uses 0, as transformers' Trainer does.

    Past total_steps a cosine schedule stays at 0 (transformers' would rise again on a second half-cycle).
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an integer >= 0, got {step!r}")
    warmup = recipe.warmup_steps
    if step < warmup:
        return recipe.lr * (float(step) / float(max(1, warmup)))
    if recipe.lr_schedule == LRSchedule.CONSTANT:
        return recipe.lr * 1.0
    if step >= recipe.total_steps:
        return recipe.lr * 0.0
    progress = float(step - warmup) / float(max(1, recipe.total_steps - warmup))
    # transformers' expression with num_cycles 0.5, term for term, so that the floats are the same
    return recipe.lr * max(0.0, 0.5 * (1.0 + math.cos(math.pi * 0.5 * 2.0 * progress)))


def global_norm(squared_norms: Iterable[float]) -> float:
    """The L2 norm of gradients split into parts, from each part's squared norm (a stage's, the trainer's).

    Summed exactly (math.fsum), so every member that adds the same parts gets the same float, in any order.

    Raises:
        ValueError: a part is negative, NaN or infinite (a gradient that is not finite).
    """
    parts = [float(x) for x in squared_norms]
    for index, part in enumerate(parts):
        if not 0.0 <= part < math.inf:
            raise ValueError(f"squared norm {index} of {len(parts)} must be finite and >= 0, got {part!r}")
    return math.sqrt(math.fsum(parts))


def clip_scale(total_norm: float, max_norm: float) -> float:
    """The factor torch.nn.utils.clip_grad_norm_ multiplies gradients by: min(1, max_norm / (total_norm + 1e-6));
    1 when max_norm is 0 (no clipping).

    Raises:
        ValueError: total_norm is not finite and >= 0, or max_norm is negative or not finite.
    """
    if not 0.0 <= max_norm < math.inf:
        raise ValueError(f"max_norm must be finite and >= 0, got {max_norm!r}")
    if max_norm == 0.0:
        return 1.0
    if not 0.0 <= total_norm < math.inf:
        raise ValueError(f"total_norm must be finite and >= 0, got {total_norm!r}")
    return min(1.0, max_norm / (total_norm + 1e-6))


# --- the run's recipe in the DHT ---


@dataclass(frozen=True)
class PublishedRecipe:
    """One publisher's record of a run's recipe."""

    recipe: RunRecipe
    publisher: str
    """The peer id whose key signed the record."""
    published_at: float
    """When the recipe was first published, by the clock of whoever says so (DHT time)."""


def publish_recipe(
    dht, prefix: str, run_id: str, recipe: RunRecipe, *, published_at: float | None = None, expiration_s=RECIPE_TTL_S
) -> float:
    """Store `recipe` as run `run_id`'s, under the signed subkey of `dht` (a node from swarm.dht.node.start_dht).

    Each member that adopted the recipe publishes it too, and again within `expiration_s` while it runs: the record
    then lives as long as the run has members, not only as long as the process that started the run.

    Args:
        published_at: when the run's recipe was first published; None keeps the earliest time already published for
            this same recipe (now, when there is none), so that vouching for it changes nothing in `read_recipe`.

    Returns:
        The published_at stored. A store that the DHT reports as refused is logged as a warning (hivemind reports
        one replica's answer, which a lying node can give): whoever needs the record reads it back.

    Raises:
        DHTUnavailableError: the DHT did not answer in time.
    """
    from hivemind.utils import get_dht_time

    from swarm.dht.node import dht_result
    from swarm.dht.validators import recipe_envelope, recipe_key

    if published_at is None:
        same = [r.published_at for r in read_recipes(dht, prefix, run_id) if r.recipe == recipe]
        published_at = min(same, default=get_dht_time())
    key = recipe_key(prefix, run_id)
    value = recipe_envelope(prefix, run_id, published_at, recipe.to_wire())
    future = dht.store(
        key, value, get_dht_time() + expiration_s, subkey=dht.identity.record_subkey(), return_future=True
    )
    if not dht_result(dht, future, f"publishing the recipe of run {run_id!r} of {prefix}"):
        logger.warning("the DHT reports that it did not store the recipe of run %r of %s", run_id, prefix)
    return published_at


def read_recipes(dht, prefix: str, run_id: str) -> list[PublishedRecipe]:
    """Every signed, well-formed record of run `run_id`'s recipe, the one that counts first (see `read_recipe`).

    Raises:
        DHTUnavailableError: the DHT did not answer in time.
    """
    from swarm.dht.node import dht_result
    from swarm.dht.validators import recipe_key

    found = dht_result(
        dht,
        dht.get(recipe_key(prefix, run_id), latest=True, return_future=True),
        f"reading the recipe of run {run_id!r} of {prefix}",
    )
    return published_recipes(found.value if found is not None else None, prefix, run_id)


def published_recipes(raw: Any, prefix: str, run_id: str) -> list[PublishedRecipe]:
    """The recipes in the entries of a recipe record (`dht.get(...).value`), the one that counts first.

    Entries under subkeys that name no key, envelopes of another run, and settings that RunRecipe refuses are
    skipped: a reader does not rely on its DHT node's validators (a node of another program may have none).
    """
    from swarm.dht.validators import check_recipe_envelope
    from swarm.trust.identity import parse_record_subkey

    records = []
    for subkey, item in raw.items() if isinstance(raw, dict) else ():
        owner = parse_record_subkey(subkey)
        try:
            if owner is None:
                raise InvalidRecordError("its subkey names no key")
            where, run, published_at, settings = check_recipe_envelope(getattr(item, "value", None))
            if (where, run) != (prefix, run_id):
                raise InvalidRecordError(f"it is the recipe of run {run!r} of {where}")
            records.append(PublishedRecipe(RunRecipe.from_wire(settings), owner[0], published_at))
        except InvalidRecordError as exc:
            logger.debug("skipping a recipe record of run %r under %.80r: %s", run_id, subkey, exc)
    records.sort(key=lambda r: (r.published_at, r.recipe.digest(), r.publisher))
    return records


def recipes_of_runs(dht, snapshots: Mapping[str, Any]) -> dict[str, dict[str, list[RunRecipe]]]:
    """prefix -> run id -> the different recipes published for each run that the ONLINE peers of `snapshots`
    (prefix -> SwarmSnapshot) train, the one that counts first.

    Raises:
        DHTUnavailableError: the DHT did not answer in time.
    """
    from swarm.dht.state import training_runs

    found: dict[str, dict[str, list[RunRecipe]]] = {}
    for prefix, snapshot in snapshots.items():
        for run_id in training_runs(snapshot.online()):
            distinct = {r.recipe.digest(): r.recipe for r in read_recipes(dht, prefix, run_id)}  # in order
            found.setdefault(prefix, {})[run_id] = list(distinct.values())
    return found


def recipes_on_wire(recipes: Mapping[str, Mapping[str, list[RunRecipe]]]) -> dict[str, dict[str, list[dict]]]:
    """`recipes_of_runs`'s answer in the form swarm/dht/state.py's document takes."""
    return {
        prefix: {run: [r.to_wire() for r in found] for run, found in runs.items()} for prefix, runs in recipes.items()
    }


def read_recipe(dht, prefix: str, run_id: str) -> RunRecipe | None:
    """The recipe of run `run_id`, or None when none is published.

    Several publishers may have written different recipes (two processes started the run at once, or a liar): the
    one published first by its own timestamp wins, ties broken by digest, so every reader picks the same one.

    What a liar can do with this rule: publish another recipe with an earlier timestamp, which every process that
    reads the recipe afterwards then takes as the run's. A joiner that gives its settings explicitly refuses to
    start when they differ (RecipeMismatchError); one that gives none adopts the liar's recipe, and then trains
    with other settings than the members that joined before (what the run's commits should catch by the recipe's
    digest). `swarmlm status` shows how many other recipes a run has.
    What a liar cannot do: write in another publisher's name (the subkey is signed), change the recipe of members
    that adopted one already (they read it once, when they start), store a recipe under another run's key or out of
    the bounds of RunRecipe (validators and readers refuse it), or make anyone train with settings other than those
    it gave explicitly.

    Raises:
        DHTUnavailableError: the DHT did not answer in time.
    """
    records = read_recipes(dht, prefix, run_id)
    return records[0].recipe if records else None


def adopt_recipe(dht, prefix: str, run_id: str, given: Mapping[str, Any], defaults: RunRecipe) -> RunRecipe:
    """The recipe this process trains run `run_id` with, published under its own key too.

    No recipe yet: `defaults` updated with `given` starts the run. One exists: every setting in `given` must equal
    the run's, and the others are adopted from it.

    Args:
        given: the settings given explicitly (a config's `recipe_overrides()`), by their names in RunRecipe.
        defaults: the recipe to start a run with, before `given` is applied.

    Raises:
        RecipeMismatchError: a given setting differs from the run's (the message lists every difference).
        ValueError: a given setting is out of range, or unknown.
        DHTUnavailableError: the DHT did not answer, or did not store the recipe of a new run.
    """
    given = check_overrides(given)
    records = read_recipes(dht, prefix, run_id)
    if not records:
        publish_recipe(dht, prefix, run_id, dataclasses.replace(defaults, **given))
        # another process may have started the run at the same moment: the earliest wins for both
        records = read_recipes(dht, prefix, run_id)
        if not records:
            raise DHTUnavailableError(
                f"the recipe of run {run_id!r} of {prefix} cannot be read back after publishing it: no DHT node "
                f"stored it, or none answered. If this repeats, the nodes that hold its key may be full (they keep "
                f"a bounded number of entries per key): start the run with another --run-id"
            )
    run, published_at = records[0].recipe, records[0].published_at
    differences = dataclasses.replace(run, **given).differences(run)
    if differences:
        raise RecipeMismatchError(
            f"the settings given differ from the recipe of run {run_id!r} of {prefix}: {'; '.join(differences)}. "
            f"Start with --run-id NEW for other settings, or drop the flag to adopt the run's"
        )
    publish_recipe(dht, prefix, run_id, run, published_at=published_at)  # vouch: it outlives its first publisher
    return run
