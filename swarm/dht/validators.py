"""The DHT-level check of records, run by every node we start next to hivemind's RSASignatureValidator.

A swarmlm DHT holds our records only, each under a signed subkey (`"<peer id>[owner:<key>]"`, swarm/trust/identity.py)
whose peer id is its key's: a block record or a training group's progress (OWNED_RECORDS, told apart by their fields),
a run's recipe, or, under the model index key, a ModelIndexEntry. Anything else is refused: a plain value (in
hivemind's storage, a plain value with a later expiry replaces a key's whole dictionary, and the key then refuses every
honest announcement until it expires), and any other subkey (anyone may write those, and nobody reads them). Keys are
hashed before they reach a validator, so this holds under every key.

Every record must also expire within MAX_RECORD_TTL_S (writers stay CLOCK_SKEW_S under it, so a reader whose clock
is behind theirs still takes what they write) and be at most MAX_VALUE_BYTES; and the node keeps a bounded number of
entries per key and bytes in all (swarm/dht/ledger.py). What fails is neither stored by an honest node nor accepted
from another node when reading (hivemind then drops that node's whole answer for the key).

A run's recipe (swarm/training/recipe.py) is an envelope that names its prefix and run id: it is accepted only under
the key those give (`recipe_key`, whose hash is recomputed here). The settings are checked here for form and size;
readers check them against RunRecipe.

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
    ModelIndexEntry,
    ServerInfo,
    TrainingProgress,
    check_prefix,
    check_run_id,
)
from swarm.dht.ledger import StorageLedger
from swarm.trust.identity import looks_like_record_subkey, parse_record_subkey

logger = logging.getLogger(__name__)

# what a signed subkey may hold; their required fields differ, so a value parses as one of them at most
OWNED_RECORDS = (ServerInfo, TrainingProgress)
MAX_VALUE_BYTES = 8192
"""A record's value as stored (msgpack): a block record is ~200 bytes (more with relays), a recipe at most ~5 KB."""
MAX_SUBKEY_BYTES = 1024
"""A signed subkey: a peer id and a 2048-bit RSA key in base64, ~440 bytes."""


class SwarmRecordValidator(RecordValidatorBase):
    """Refuses what is not one of our records, caps their lifetime and size, and bounds what the node keeps."""

    def __init__(self, max_ttl_s: float = MAX_RECORD_TTL_S, ledger: StorageLedger | None = None):
        self.max_ttl_s = max_ttl_s
        self.index_key = DHTID.generate(source=MODEL_INDEX_KEY).to_bytes()
        self.ledger = ledger if ledger is not None else StorageLedger()

    def validate(self, record: DHTRecord) -> bool:
        try:
            self._check(record)
        except Exception as exc:  # whatever a stranger sent must not break the node's handling of the rest
            logger.debug("refusing a record: %s", exc)
            return False
        size = len(record.key) + len(record.subkey) + len(record.value)
        if not self.ledger.admit(record.key, record.subkey, record.expiration_time, size, get_dht_time()):
            logger.debug("refusing a record: this node holds as much as it keeps under its key or in all")
            return False
        return True

    def _check(self, record: DHTRecord) -> None:
        if len(record.subkey) > MAX_SUBKEY_BYTES or len(record.value) > MAX_VALUE_BYTES:
            raise InvalidRecordError(f"{len(record.subkey)}-byte subkey, {len(record.value)}-byte value: too big")
        subkey = MSGPackSerializer.loads(record.subkey)
        if subkey is None:  # hivemind's mark of a plain value
            raise InvalidRecordError("a plain value (ours are all under signed subkeys)")
        if not looks_like_record_subkey(subkey):  # cheap: no key is parsed
            raise InvalidRecordError(f"subkey {subkey!r:.80} is not a signed one")
        if record.expiration_time > get_dht_time() + self.max_ttl_s:
            raise InvalidRecordError(
                f"it expires {record.expiration_time - get_dht_time():.0f}s ahead (at most {self.max_ttl_s:.0f}s)"
            )
        owner = parse_record_subkey(subkey)
        if owner is None:
            raise InvalidRecordError("its peer id is not its key's")
        value = MSGPackSerializer.loads(record.value)
        if record.key == self.index_key:
            ModelIndexEntry.from_wire(value)
        elif isinstance(value, dict) and value.get("kind") == RECIPE_KIND:
            _check_recipe_record(value, record.key)
        else:
            _parse_owned(value)

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


def _check_recipe_record(value: Any, key: bytes) -> None:
    prefix, run_id, _, _ = check_recipe_envelope(value)
    if DHTID.generate(source=recipe_key(prefix, run_id)).to_bytes() != key:
        raise InvalidRecordError(f"a recipe of {prefix} run {run_id} stored under another key")
