"""The DHT-level check of our records, run by every node we start next to hivemind's RSASignatureValidator.

A record is ours when it is under the model index key, or when its subkey has the form of a block record's
(`"<peer id>[owner:<key>]"`: keys are hashed before they reach a validator, so a block key itself cannot be
recognised). Ours must expire within MAX_RECORD_TTL_S and parse as our schema; what fails is neither stored by an
honest node nor accepted from another node when reading (hivemind then drops that node's whole answer for the key).
Block records under other subkeys cannot be told from other applications' records here: readers ignore them
(swarm/dht/directory.py).

The check depends on the clock only through the TTL, which a stored record keeps satisfying as time passes, so a
record accepted once stays valid wherever it is replicated. (Rules that expire with time, like the bound on
JOINING, belong to readers: a validator that turned a stored record invalid would drop every record stored with it.)

Validators are pickled into the DHT's process: this one holds plain data only.
"""

from __future__ import annotations

import logging

from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import MSGPackSerializer, get_dht_time

from protocol.errors import InvalidRecordError
from protocol.records import MAX_RECORD_TTL_S, MODEL_INDEX_KEY, ModelRecord, ServerInfo, check_prefix
from swarm.trust.identity import looks_like_record_subkey, parse_record_subkey

logger = logging.getLogger(__name__)


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
        if not is_index and not looks_like_record_subkey(subkey):
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
                if parse_record_subkey(subkey) is None:
                    raise InvalidRecordError("its peer id is not its key's")
                ServerInfo.from_wire(value)
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
