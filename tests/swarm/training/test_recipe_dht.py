"""A run's recipe in the DHT, on real hivemind DHT processes on 127.0.0.1: published signed, adopted or refused
with every difference named, and the records a stranger or a bare hivemind node writes refused or skipped."""

from __future__ import annotations

import hivemind
import pytest
from hivemind.dht.routing import DHTID
from hivemind.utils import MSGPackSerializer, ValueWithExpiration, get_dht_time

from protocol.errors import RecipeMismatchError
from protocol.records import ModelRecord, ServerInfo, ServerState
from swarm.dht.directory import announce
from swarm.dht.node import dht_result, start_dht, start_plain_dht, stop_dht, visible_maddrs
from swarm.dht.state import read_state
from swarm.dht.validators import recipe_envelope, recipe_key
from swarm.status import format_snapshot
from swarm.training.recipe import (
    RunRecipe,
    adopt_recipe,
    publish_recipe,
    published_recipes,
    read_recipe,
    read_recipes,
    recipes_of_runs,
)
from swarm.trust.identity import fresh_identity

PREFIX = "tiny"
HONEST_STORES = ("boot", "first", "second")  # nodes with our validators that store records


@pytest.fixture(scope="module")
def nodes():
    started = []
    try:
        boot = start_dht()
        started.append(boot)
        maddrs = visible_maddrs(boot)
        for start in [
            lambda: start_dht(maddrs),
            lambda: start_dht(maddrs),
            lambda: start_plain_dht(maddrs),
            lambda: start_dht(maddrs, client_mode=True),
        ]:
            started.append(start())
        yield dict(zip(["boot", "first", "second", "attacker", "reader"], started))
    finally:
        for node in reversed(started):
            stop_dht(node)


class _Store:
    """Store one value from inside a node's process, as any program on it could (picklable for run_coroutine)."""

    def __init__(self, key, subkey, value, expiration_s: float):
        self.key, self.subkey, self.value, self.expiration_s = key, subkey, value, expiration_s

    async def __call__(self, dht, node) -> bool:
        return bool(await node.store(self.key, self.value, get_dht_time() + self.expiration_s, subkey=self.subkey))


class _Held:
    """Whether a node keeps `subkey` (None: a plain value) under `key` in its own storage."""

    def __init__(self, key, subkey):
        self.key, self.subkey = key, subkey

    async def __call__(self, dht, node) -> bool:
        item = node.protocol.storage.get(DHTID.generate(source=self.key))
        if item is None:
            return False
        if self.subkey is None:
            return not isinstance(item.value, hivemind.dht.storage.DictionaryDHTValue)
        return isinstance(item.value, hivemind.dht.storage.DictionaryDHTValue) and self.subkey in item.value


def store(node, key, subkey, value, expiration_s: float = 60.0) -> None:
    dht_result(node, node.run_coroutine(_Store(key, subkey, value, expiration_s), return_future=True), "store")


def held_by_honest_nodes(nodes, key, subkey) -> list[bool]:
    return [
        dht_result(nodes[name], nodes[name].run_coroutine(_Held(key, subkey), return_future=True), "read")
        for name in HONEST_STORES
    ]


def test_the_first_member_starts_the_run_and_the_others_adopt_it_or_say_why_not(nodes):
    first, second = nodes["first"], nodes["second"]
    assert read_recipe(nodes["reader"], PREFIX, "adopt") is None
    started = adopt_recipe(first, PREFIX, "adopt", {"lr": 3e-4, "warmup_steps": 5}, RunRecipe(batch_size=16))
    assert started == RunRecipe(lr=3e-4, warmup_steps=5, batch_size=16)
    assert read_recipe(nodes["reader"], PREFIX, "adopt") == started
    # given nothing: it adopts the run's, whatever its own defaults
    assert adopt_recipe(second, PREFIX, "adopt", {}, RunRecipe(lr=1.0)) == started
    # given the run's own values: adopted too
    assert adopt_recipe(second, PREFIX, "adopt", {"lr": 0.0003, "batch_size": 16}, RunRecipe()) == started
    with pytest.raises(RecipeMismatchError) as refused:
        adopt_recipe(second, PREFIX, "adopt", {"lr": 1e-3, "optimizer": "sgd", "warmup_steps": 5}, RunRecipe())
    assert str(refused.value) == (
        "the settings given differ from the recipe of run 'adopt' of tiny: optimizer: 'sgd' here, 'adamw' in the "
        "run's recipe; lr: 0.001 here, 0.0003 in the run's recipe. Start with --run-id NEW for other settings, or "
        "drop the flag to adopt the run's"
    )
    with pytest.raises(ValueError, match="total_steps must exceed warmup_steps"):
        adopt_recipe(second, PREFIX, "adopt-bad", {"lr_schedule": "cosine"}, RunRecipe())


def test_every_member_vouches_for_the_recipe_with_the_time_it_was_first_published(nodes):
    first, second = nodes["first"], nodes["second"]
    recipe = adopt_recipe(first, PREFIX, "vouch", {"max_grad_norm": 1.0}, RunRecipe())
    adopt_recipe(second, PREFIX, "vouch", {}, RunRecipe())
    records = read_recipes(nodes["reader"], PREFIX, "vouch")
    assert {r.publisher for r in records} == {first.identity.peer_id, second.identity.peer_id}
    assert {r.recipe for r in records} == {recipe} and len({r.published_at for r in records}) == 1
    # renewing keeps that time: the record outlives its first publisher without changing which recipe counts
    assert publish_recipe(second, PREFIX, "vouch", recipe) == records[0].published_at


def test_of_different_recipes_the_one_published_first_counts_for_every_reader(nodes):
    first, second = nodes["first"], nodes["second"]
    now = get_dht_time()
    publish_recipe(first, PREFIX, "race", RunRecipe(lr=1e-3), published_at=now)
    publish_recipe(second, PREFIX, "race", RunRecipe(lr=2e-3), published_at=now - 10)  # earlier by its own clock
    for reader in (nodes["reader"], first, second):
        assert read_recipe(reader, PREFIX, "race") == RunRecipe(lr=2e-3)
    assert [r.recipe.lr for r in read_recipes(nodes["reader"], PREFIX, "race")] == [2e-3, 1e-3]
    # the one that lost, starting now, is told that its setting differs
    with pytest.raises(RecipeMismatchError, match=r"lr: 0\.001 here, 0\.002 in the run's recipe"):
        adopt_recipe(first, PREFIX, "race", {"lr": 1e-3}, RunRecipe())


def test_a_recipe_only_counts_signed_under_its_own_key(nodes):
    first, attacker = nodes["first"], nodes["attacker"]
    key, mine = recipe_key(PREFIX, "forged"), first.identity.record_subkey()
    envelope = recipe_envelope(PREFIX, "forged", get_dht_time() - 100, RunRecipe(lr=0.5).to_wire())
    bad = [
        (None, envelope),  # a plain value anyone could write
        (first.identity.peer_id, envelope),  # a subkey with no key: anyone could write it
        (mine, recipe_envelope(PREFIX, "other-run", get_dht_time(), RunRecipe().to_wire())),  # another run's
        (mine, envelope | {"published_at": float("nan")}),
        (mine, envelope | {"settings": {"lr": "x" * 100}}),
        (mine, envelope | {"extra": 1}),
    ]
    for subkey, value in bad:
        store(first, key, subkey, value)
        assert held_by_honest_nodes(nodes, key, subkey) == [False] * 3, (subkey, value)
    # a bare hivemind node keeps and offers whatever it likes: readers skip what is not signed or not a recipe
    store(attacker, key, "junk", envelope)
    store(attacker, key, attacker.peer_id.to_base58(), envelope | {"settings": {"lr": -1.0}})
    assert read_recipe(nodes["reader"], PREFIX, "forged") is None
    # control: the same record, signed under the publisher's own subkey and the run's key, counts
    store(first, key, mine, envelope)
    assert held_by_honest_nodes(nodes, key, mine) == [True] * 3
    assert read_recipe(nodes["reader"], PREFIX, "forged") == RunRecipe(lr=0.5)
    # settings the envelope admits but RunRecipe refuses (the validator checks form and size only) are skipped
    store(nodes["second"], key, nodes["second"].identity.record_subkey(), envelope | {"settings": {"lr": -1.0}})
    assert [r.publisher for r in read_recipes(nodes["reader"], PREFIX, "forged")] == [first.identity.peer_id]


def test_a_plain_value_under_the_key_is_refused_and_the_run_starts(nodes):
    # in hivemind's storage a plain value would hold the key over any dictionary that expires before it
    key = recipe_key(PREFIX, "blocked")
    store(nodes["attacker"], key, None, b"mine", expiration_s=3600)
    assert not any(held_by_honest_nodes(nodes, key, None))
    assert adopt_recipe(nodes["first"], PREFIX, "blocked", {}, RunRecipe()) == RunRecipe()


def test_records_keep_the_recipe_exactly():
    recipe = RunRecipe(lr=1 / 3, weight_decay=0.1 + 0.2, max_grad_norm=1e-300)
    envelope = recipe_envelope(PREFIX, "exact", 1.5, recipe.to_wire())
    read = RunRecipe.from_wire(MSGPackSerializer.loads(MSGPackSerializer.dumps(envelope))["settings"])
    assert read == recipe and read.digest() == recipe.digest()


def test_a_reader_skips_what_its_own_node_might_have_let_through():
    # a reader's DHT node may run other validators than ours (or none): what it reads is checked again
    honest, liar = fresh_identity(), fresh_identity()
    for identity in (honest, liar):
        identity.started()
    envelope = recipe_envelope(PREFIX, "run", 5.0, RunRecipe(lr=0.5).to_wire())
    raw = {
        honest.record_subkey(): ValueWithExpiration(envelope, 0.0),
        liar.peer_id: ValueWithExpiration(envelope | {"published_at": 1.0}, 0.0),  # no key: anyone could write it
        f"{honest.peer_id}[owner:{liar.public_key.decode()}]": ValueWithExpiration(envelope, 0.0),  # not its key
        liar.record_subkey(): ValueWithExpiration(recipe_envelope(PREFIX, "other", 1.0, envelope["settings"]), 0.0),
    }
    [found] = published_recipes(raw, PREFIX, "run")
    assert found.recipe == RunRecipe(lr=0.5) and found.publisher == honest.peer_id and found.published_at == 5.0
    raw[liar.record_subkey()] = ValueWithExpiration(envelope | {"settings": envelope["settings"] | {"lr": -1.0}}, 0)
    assert len(published_recipes(raw, PREFIX, "run")) == 1
    assert published_recipes(b"a plain value", PREFIX, "run") == published_recipes(None, PREFIX, "run") == []


def test_status_reads_the_recipe_of_each_run_its_peers_train(nodes):
    first = nodes["first"]
    record = ServerInfo(
        state=ServerState.ONLINE,
        start_block=0,
        end_block=2,
        throughput=1.0,
        cache_tokens_left=1,
        dtype="float32",
        version="1",
        endpoint="127.0.0.1:5000",
        run_id="shown",
    )
    assert announce(first, "status-model", record, ModelRecord(num_blocks=2, repository="r"), expiration_s=60) == []
    recipe = adopt_recipe(first, "status-model", "shown", {"warmup_steps": 7}, RunRecipe())
    _, snapshots = read_state(nodes["reader"], "status-model")
    recipes = recipes_of_runs(nodes["reader"], snapshots)
    assert recipes == {"status-model": {"shown": [recipe]}}
    assert "run 'shown': adamw lr 0.0001 (constant, warmup 7)" in format_snapshot(
        "status-model", "r", snapshots["status-model"], recipes["status-model"]
    )
