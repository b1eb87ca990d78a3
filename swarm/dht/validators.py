"""The DHT-level check of our records, run by every node we start next to hivemind's RSASignatureValidator.

A record is ours when it is under the model index key, or when its subkey has the form of a signed one
(`"<peer id>[owner:<key>]"`: keys are hashed before they reach a validator, so a block key itself cannot be
recognised). Ours must expire within MAX_RECORD_TTL_S and parse as our schema: under a signed subkey, one of
OWNED_RECORDS (a block record, or a training group's progress), told apart by their fields; what fails is neither
stored by an honest node nor accepted from another node when reading (hivemind then drops that node's whole answer
for the key). Records under other subkeys cannot be told from other applications' records here: readers ignore them
(swarm/dht/directory.py, swarm/training/members.py).

A run's recipe (swarm/training/recipe.py) is an envelope that names its prefix and run id: it is accepted only under a
signed subkey and under the key those give (`recipe_key`, whose hash is recomputed here), never as a plain value.
Another plain value under that key cannot be recognised (the key is hashed): readers skip what does not parse, and a
publisher whose store it blocks is told so. The settings are checked here for form and size; readers check them
against RunRecipe.

The check depends on the clock only through the TTL, which a stored record keeps satisfying as time passes, so a
record accepted once stays valid wherever it is replicated. (Rules that expire with time, like the bound on
JOINING, belong to readers: a validator that turned a stored record invalid would drop every record stored with it.)

Validators are pickled into the DHT's process: this one holds plain data only.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import MSGPackSerializer, get_dht_time

from protocol.errors import InvalidRecordError
from protocol.records import (
    MAX_RECORD_TTL_S,
    MODEL_INDEX_KEY,
    ModelRecord,
    ServerInfo,
    TrainingProgress,
    check_prefix,
    check_run_id,
)
from swarm.trust.identity import looks_like_record_subkey, parse_record_subkey

logger = logging.getLogger(__name__)

# what a signed subkey may hold; their required fields differ, so a value parses as one of them at most
OWNED_RECORDS = (ServerInfo, TrainingProgress)


class SwarmRecordValidator(RecordValidatorBase):
    """Caps the lifetime of our records and checks them against protocol/records.py."""

    def __init__(self, max_ttl_s: float = MAX_RECORD_TTL_S):
        self.max_ttl_s = max_ttl_s
        self.index_key = DHTID.generate(source=MODEL_INDEX_KEY).to_bytes()

    def validate(self, record: DHTRecord) -> bool:
        is_index = record.key == self.index_key
        try:
            subkey = MSGPackSerializer.loads(record.subkey) if record.subkey else None
        except Exception:
            subkey = None
        recipe = not is_index and RECIPE_KIND.encode() in record.value and _is_recipe(record.value)  # cheap first
        if not is_index and not recipe and not looks_like_record_subkey(subkey):
            return True  # not ours
        if record.expiration_time > get_dht_time() + self.max_ttl_s:
            logger.debug(
                "refusing a record expiring %.0fs ahead (at most %.0fs)",
                record.expiration_time - get_dht_time(),
                self.max_ttl_s,
            )
            return False
        try:
            value = MSGPackSerializer.loads(record.value)
            if is_index:
                # one entry per model, written by all its peers alike, so it cannot have one owner; it only
                # names a block count and a repository, which `swarmlm status` shows (clients and peers take the
                # block count from the model's own config)
                check_prefix(subkey)
                ModelRecord.from_wire(value)
            else:
                if recipe:
                    _check_recipe_record(value, record.key, parse_record_subkey(subkey))
                    return True
                if parse_record_subkey(subkey) is None:
                    raise InvalidRecordError("its peer id is not its key's")
                _parse_owned(value)
        except Exception as exc:  # whatever a stranger sent must not break the node's handling of the rest
            logger.debug("refusing a record under %r: %s", subkey, exc)
            return False
        return True

    @property
    def priority(self) -> int:
        # below RSASignatureValidator's 10: it checks and strips the signature before this one parses the value
        return 0

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return isinstance(other, SwarmRecordValidator)  # one is enough


def _parse_owned(value) -> None:
    errors = []
    for schema in OWNED_RECORDS:
        try:
            schema.from_wire(value)
            return
        except InvalidRecordError as exc:
            errors.append(str(exc))
    raise InvalidRecordError("; ".join(errors))


RECIPE_KIND = "swarmlm.recipe"
RECIPE_FIELDS = ("kind", "prefix", "run_id", "published_at", "settings")
MAX_RECIPE_SETTINGS = 32
MAX_RECIPE_TEXT = 64  # characters of a setting's name or text value


def recipe_key(prefix: str, run_id: str) -> str:
    """The DHT key of a training run's recipe; its subkeys are the publishers' signed subkeys."""
    return f"{prefix}.train.{run_id}.recipe"


def recipe_envelope(prefix: str, run_id: str, published_at: float, settings: dict[str, Any]) -> dict[str, Any]:
    """What a publisher stores under `recipe_key(prefix, run_id)`."""
    return dict(zip(RECIPE_FIELDS, (RECIPE_KIND, prefix, run_id, float(published_at), settings)))


def check_recipe_envelope(value: Any) -> tuple[str, str, float, dict[str, Any]]:
    """(prefix, run id, published_at, settings) of a recipe envelope, its form and size checked.

    Raises:
        InvalidRecordError: it is not one.
    """
    if not isinstance(value, dict) or value.get("kind") != RECIPE_KIND or set(value) != set(RECIPE_FIELDS):
        raise InvalidRecordError(f"a recipe record is a dict of {', '.join(RECIPE_FIELDS)}")
    _, prefix, run_id, published_at, settings = (value[name] for name in RECIPE_FIELDS)
    try:
        check_prefix(prefix)
        check_run_id(run_id)
    except (TypeError, ValueError) as exc:
        raise InvalidRecordError(f"in a recipe record: {exc}") from None
    if type(published_at) is not float or not 0.0 <= published_at < math.inf:
        raise InvalidRecordError(f"a recipe's published_at must be a finite float >= 0, got {published_at!r}")
    if not isinstance(settings, dict) or len(settings) > MAX_RECIPE_SETTINGS:
        raise InvalidRecordError(f"a recipe's settings must be a dict of at most {MAX_RECIPE_SETTINGS} entries")
    for name, setting in settings.items():
        if not isinstance(name, str) or len(name) > MAX_RECIPE_TEXT:
            raise InvalidRecordError(f"a recipe's setting names must be text of at most {MAX_RECIPE_TEXT} characters")
        short_text = isinstance(setting, str) and len(setting) <= MAX_RECIPE_TEXT
        if not short_text and not (type(setting) in (int, float) and math.isfinite(setting)):
            raise InvalidRecordError(f"recipe setting {name} must be a finite number or short text, got {setting!r}")
    return prefix, run_id, published_at, settings


def _is_recipe(raw: bytes) -> bool:
    try:
        value = MSGPackSerializer.loads(raw)
    except Exception:
        return False
    return isinstance(value, dict) and value.get("kind") == RECIPE_KIND


def _check_recipe_record(value: Any, key: bytes, owner: tuple[str, bytes] | None) -> None:
    prefix, run_id, _, _ = check_recipe_envelope(value)
    if owner is None:
        raise InvalidRecordError("a recipe must be stored under its publisher's signed subkey")
    if DHTID.generate(source=recipe_key(prefix, run_id)).to_bytes() != key:
        raise InvalidRecordError(f"a recipe of {prefix} run {run_id} stored under another key")
