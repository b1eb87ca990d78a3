"""Named LoRA adapters served on a span: each row of a batch computes through its own adapter, as peft computes it."""

from __future__ import annotations

import contextlib
import copy
import io
import json
from pathlib import Path

import pytest
import torch

from peer.adapters import ServedAdapters, read_adapter
from peer.batching import forward_batch
from peer.blocks import BlockSpan, load_span
from peer.cli import build_parser, config_from_args
from peer.config import PeerConfig, TrainingConfig
from protocol.errors import BadRequestError, InvalidRecordError
from protocol.records import MAX_ADAPTERS, AdapterInfo, ServerInfo, ServerState
from swarm.models.checkpoint import load_config
from tests.helpers.adapters import local_peft, save_random_adapter
from tests.helpers.models import CONFIGS, make_tiny, save_random_model

BLOCKS = (1, 3)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def folders(request, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp(f"adapters-{request.param}")
    model = make_tiny(request.param, root / "model", num_layers=4, seed=3)
    return {
        "family": request.param,
        "model": model,
        "poems": save_random_adapter(model, root / "poems", seed=1),
        # another rank, other layers, and only some blocks: block 1 of the span has none of it
        "law": save_random_adapter(
            model, root / "law", seed=2, rank=2, target_modules=("k_proj", "up_proj"), layers=[0, 2]
        ),
    }


def _span(folders: dict[str, Path], names=("poems", "law")) -> BlockSpan:
    span = load_span(
        folders["model"], load_config(folders["model"]), *BLOCKS, dtype=torch.float32, device=torch.device("cpu")
    )
    span.adapters = ServedAdapters(span.layers, span.start, [read_adapter(n, folders[n]) for n in names])
    return span


def _peft_hidden(folders: dict[str, Path], name: str | None, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What peft's whole model feeds block 1 and what block 2 gives out, with adapter `name` (None: the base)."""
    model = local_peft(folders["model"], folders[name or "poems"])
    with torch.no_grad(), model.disable_adapter() if name is None else torch.no_grad():
        states = model(ids, output_hidden_states=True).hidden_states
    return states[BLOCKS[0]], states[BLOCKS[1]]


def _ids(batch: int = 3, length: int = 6) -> torch.Tensor:
    return torch.randint(0, 128, (batch, length), generator=torch.Generator().manual_seed(7))


def test_each_adapter_computes_what_peft_computes(folders):
    span, ids = _span(folders), _ids()
    for name in ("poems", "law", None):
        inputs, expected = _peft_hidden(folders, name, ids)
        with torch.no_grad():
            got = span(inputs, adapter=name)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5, msg=f"adapter {name}")
        assert name is None or not torch.allclose(got, _peft_hidden(folders, None, ids)[1], atol=1e-3)


def test_rows_of_one_batch_take_their_own_adapters(folders):
    span = _span(folders)
    hidden = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        alone = [span(hidden[i : i + 1], adapter=name) for i, name in enumerate(["law", "", "poems"])]
        with span.adapter_rows(["law", "", "poems"], 3):
            mixed = span._forward(hidden, None, None, None, 0, None, None, None)
        plain = load_span(
            folders["model"], load_config(folders["model"]), *BLOCKS, dtype=torch.float32, device=torch.device("cpu")
        )
        base = plain(hidden[1:2])
    # a batch of 3 rows sums in another order than one row (BLAS picks kernels by shape): float32 rounding apart
    torch.testing.assert_close(mixed, torch.cat(alone), atol=1e-5, rtol=1e-5)
    assert float((alone[0] - base).abs().max()) > 1e-3 and float((alone[2] - base).abs().max()) > 1e-3
    assert torch.equal(alone[1], base)  # no adapter: exactly the span without any


def test_a_forward_run_between_layers_keeps_the_outer_adapter(folders):
    """A prefill yields to other tasks between its layers (peer/compute.py): their rows must not leak into it."""
    span = _span(folders)
    hidden = torch.randn(1, 4, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = span(hidden, adapter="poems")
        got = span(hidden, adapter="poems", between_layers=lambda: span(hidden, adapter="law"))
        base = span(hidden, between_layers=lambda: span(hidden, adapter="poems"))
        assert torch.equal(got, expected)
        assert torch.equal(base, span(hidden))


def test_unknown_adapters_are_refused(folders):
    span = _span(folders, names=("poems",))
    with pytest.raises(BadRequestError, match="no adapter 'law' here; this peer serves \\['poems'\\]"):
        span(torch.zeros(1, 2, 64), adapter="law")
    plain = load_span(
        folders["model"], load_config(folders["model"]), *BLOCKS, dtype=torch.float32, device=torch.device("cpu")
    )
    with pytest.raises(BadRequestError, match="served without adapters"):
        plain(torch.zeros(1, 2, 64), adapter="poems")


def test_folders_a_peer_cannot_serve_are_refused_with_the_reason(folders, tmp_path):
    with pytest.raises(ValueError, match="not a peft adapter folder"):
        read_adapter("x", tmp_path)
    with pytest.raises(ValueError, match="adapter name"):
        read_adapter("no spaces", folders["poems"])
    dora = save_random_adapter(folders["model"], tmp_path / "dora", seed=4)
    settings = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**settings, "use_dora": True}))
    with pytest.raises(ValueError, match="DoRA"):
        read_adapter("dora", dora)
    llama = make_tiny("llama", tmp_path / "llama", num_layers=4)  # untied: peft warns of adapting a tied head
    head = save_random_adapter(llama, tmp_path / "head", seed=5, target_modules=("q_proj", "lm_head"))
    with pytest.raises(ValueError, match="outside the decoder layers"):
        read_adapter("head", head)
    config = CONFIGS[folders["family"]](4)
    config.intermediate_size = 96
    other = save_random_model(config, tmp_path / "other", seed=3)
    wide = save_random_adapter(other, tmp_path / "wide", seed=6, target_modules=("down_proj",))
    with pytest.raises(ValueError, match="made for another model"):
        _span(folders | {"wide": wide}, names=("wide",))


def test_the_record_names_each_adapter_by_its_folders_digest(folders, tmp_path):
    poems = read_adapter("poems", folders["poems"])
    assert poems.digest == read_adapter("again", folders["poems"]).digest
    assert poems.digest != read_adapter("law", folders["law"]).digest
    assert not poems.client_modules
    llama = make_tiny("llama", tmp_path / "llama", num_layers=4)  # untied: peft warns of saving a tied head
    whole = save_random_adapter(llama, tmp_path / "whole", seed=8, modules_to_save=["lm_head"])
    assert read_adapter("whole", whole).client_modules


def test_decode_steps_of_sessions_with_different_adapters_batch_exactly(folders):
    """Sessions of other lengths and adapters in one batched decode step (peer/batching.py): each gets its own."""
    span, generator = _span(folders), torch.Generator().manual_seed(2)
    names, lengths = ["poems", "", "law"], [5, 3, 7]
    caches, alone = [span.new_cache() for _ in names], []
    steps = [torch.randn(1, 1, 64, generator=generator) for _ in names]
    with torch.no_grad():
        for name, length, cache, step in zip(names, lengths, caches, steps):
            span(torch.randn(1, length, 64, generator=generator), cache=cache, adapter=name)
            twin = copy.deepcopy(cache)
            alone.append(span(step, cache=twin, prefix_length=length, adapter=name))
        positions = [torch.tensor([[length]]) for length in lengths]
        batched = forward_batch(span, steps, positions, caches, BLOCKS, names)
    for got, expected in zip(batched, alone):  # to rounding, as any batch (tests/peer/test_batching.py)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_peers_that_cannot_serve_adapters_say_which_flag_to_drop():
    for kwargs, message in [
        (dict(blocks=(0, 2), training=TrainingConfig(run_id="r")), "drop --adapters or --train"),
        (dict(quantization="nf4"), "drop --adapters or --quantize nf4"),
        (dict(blocks=(0, 2), memory_budget=1 << 20, offload="disk"), "drop --adapters or --offload disk"),
        (dict(), None),
    ]:
        config = dict(model="m", adapters={"poems": "dir"}, **kwargs)
        if message is None:
            assert PeerConfig(**config).adapters == {"poems": "dir"}
        else:
            with pytest.raises(ValueError, match=message):
                PeerConfig(**config)
    with pytest.raises(ValueError, match="adapter name 'a b'"):
        PeerConfig(model="m", adapters={"a b": "dir"})
    with pytest.raises(ValueError, match="names \\['x'\\] more than once"):
        config_from_args(build_parser("swarmlm peer").parse_args(["m", "--adapters", "x=a", "x=b"]))
    with contextlib.redirect_stderr(io.StringIO()) as err, pytest.raises(SystemExit):
        build_parser("swarmlm peer").parse_args(["m", "--adapters", "poems"])
    assert "expected NAME=DIR" in err.getvalue()


def test_records_list_adapters_only_when_there_are_some():
    info = dict(state=ServerState.ONLINE, start_block=0, end_block=2, throughput=1.0, cache_tokens_left=8,
                dtype="float32", version="3.0", endpoint="127.0.0.1:1")  # fmt: skip
    plain = ServerInfo(**info)
    assert "adapters" not in plain.to_wire()  # read by clients that predate the field, as before
    assert ServerInfo.from_wire({**plain.to_wire(), "adapters": []}).adapters == ()  # what version 2 announced
    poems = AdapterInfo(name="poems", digest="0123456789abcdef", client_modules=True)
    served = ServerInfo(**info, adapters=(poems,))
    assert ServerInfo.from_wire(served.to_wire()).adapters == (poems,)
    for bad in (
        [poems.to_wire(), poems.to_wire()],  # one name twice
        [{**poems.to_wire(), "digest": "xyz"}],
        [{**poems.to_wire(), "name": "a" * 65}],
        [poems.to_wire() | {"name": f"a{i}"} for i in range(MAX_ADAPTERS + 1)],
    ):
        with pytest.raises(InvalidRecordError):
            ServerInfo.from_wire({**plain.to_wire(), "adapters": bad})
