"""LoRA adapters on a span: they start as a no-op, train alone, and export as a plain checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from peer.blocks import BlockSpan, load_span
from peer.lora import LoraSettings, adapter_state, add_lora, layer_state, load_adapter_state, merged_layer_state
from swarm.models.checkpoint import load_config, load_tensors
from tests.helpers.models import CONFIGS, make_tiny

# scale alpha / rank = 4: an export that forgot the scale, or applied it twice, is off by far more than 1e-5
SETTINGS = LoraSettings(rank=4, alpha=16.0)
BLOCKS = (1, 3)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def checkpoint(request, tmp_path_factory) -> Path:
    return make_tiny(request.param, tmp_path_factory.mktemp(request.param), num_layers=4, seed=5)


def _span(path: Path, blocks=BLOCKS, dtype=torch.float32) -> BlockSpan:
    return load_span(path, load_config(path), *blocks, dtype=dtype, device=torch.device("cpu"))


def _adapted(path: Path, *, seed: int = 0, blocks=BLOCKS, dtype=torch.float32) -> tuple[BlockSpan, list]:
    span = _span(path, blocks, dtype)
    return span, add_lora(span, SETTINGS, seed=seed)


def _randomize(span: BlockSpan, seed: int, std: float = 0.05) -> None:
    """Adapters far from their zero start (B = 0), as after much training, so that they change the outputs."""
    generator = torch.Generator().manual_seed(seed)
    load_adapter_state(
        span, {name: torch.randn(t.shape, generator=generator) * std for name, t in adapter_state(span).items()}
    )


def _inputs(batch: int = 2, length: int = 7):
    generator = torch.Generator().manual_seed(11)
    hidden = torch.randn(batch, length, 64, generator=generator)
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[1, :2] = 0  # left padding
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return hidden, mask, positions


def _run(span: BlockSpan) -> torch.Tensor:
    hidden, mask, positions = _inputs()
    with torch.no_grad():
        return span(hidden.to(span.dtype), mask, positions)


def _base_params(span: BlockSpan) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in span.named_parameters() if "lora_" not in name}


def test_fresh_adapters_compute_exactly_what_the_base_span_computes(checkpoint):
    span, params = _adapted(checkpoint)
    layers = BLOCKS[1] - BLOCKS[0]
    assert len(params) == 2 * len(SETTINGS.target) * layers  # an A and a B for every target of every block
    assert all(p.abs().sum() > 0 for name, p in adapter_state(span).items() if name.endswith("lora_A.weight"))
    assert torch.equal(_run(span), _run(_span(checkpoint)))


def test_a_training_step_changes_only_the_adapters(checkpoint):
    span, params = _adapted(checkpoint)
    span.train()
    before, base_before = _run(span), _base_params(span)
    hidden, mask, positions = _inputs()
    loss = (span(hidden, mask, positions) * torch.randn(hidden.shape, generator=torch.Generator().manual_seed(2))).sum()
    loss.backward()
    with_grad = {name for name, p in span.named_parameters() if p.grad is not None}
    assert with_grad == {name for name, p in span.named_parameters() if "lora_" in name}
    assert all(p.requires_grad for p in params) and len(with_grad) == len(params)
    torch.optim.SGD(params, lr=1e-2).step()
    assert (_run(span) - before).abs().max() > 1e-3
    after = _base_params(span)
    assert after.keys() == base_before.keys() and all(torch.equal(after[n], base_before[n]) for n in after)


# (W + s * B @ A) x and W x + s * B (A x) round differently: in float32, with outputs up to ~20, by up to ~3e-5;
# in float64 the merge is checked to 1e-10, while adapters move the outputs by units and a wrong scale by >1e-2
@pytest.mark.parametrize("dtype, atol", [(torch.float64, 1e-10), (torch.float32, 1e-4)], ids=["fp64", "fp32"])
def test_merged_state_is_a_plain_checkpoint_that_computes_what_the_adapted_span_does(checkpoint, dtype, atol):
    span, _ = _adapted(checkpoint, dtype=dtype)
    _randomize(span, seed=1)
    expected, base_before = _run(span), _base_params(span)
    merged = merged_layer_state(span)

    names = load_tensors(checkpoint, lambda n: any(n.startswith(f"model.layers.{i}.") for i in range(*BLOCKS)))
    assert set(merged) == set(names)
    plain = _span(checkpoint, dtype=dtype)
    assert (expected - _run(plain)).abs().max() > 1e-2  # the adapters matter, so the comparison below can fail
    for j, layer in enumerate(plain.layers):
        prefix = f"model.layers.{BLOCKS[0] + j}."
        layer.load_state_dict({n[len(prefix) :]: t for n, t in merged.items() if n.startswith(prefix)}, strict=True)
    torch.testing.assert_close(_run(plain), expected, atol=atol, rtol=0)

    after = _base_params(span)  # the span itself is left unmerged
    assert all(torch.equal(after[n], base_before[n]) for n in after)
    assert torch.equal(_run(span), expected)


def test_layer_state_of_a_plain_span_is_its_checkpoint(checkpoint):
    span = _span(checkpoint)
    state = layer_state(span)
    names = load_tensors(checkpoint, lambda n: any(n.startswith(f"model.layers.{i}.") for i in range(*BLOCKS)))
    assert state.keys() == names.keys() and all(torch.equal(state[n], names[n]) for n in names)
    assert merged_layer_state(span).keys() == names.keys()

    add_lora(span, SETTINGS)
    with pytest.raises(ValueError, match="use merged_layer_state"):
        layer_state(span)


def test_adapter_state_round_trips_onto_another_span(checkpoint):
    source, _ = _adapted(checkpoint, seed=0)
    _randomize(source, seed=3)
    state = adapter_state(source)
    assert list(state) == sorted(state)
    assert all(
        n.startswith(("model.layers.1.", "model.layers.2.")) and n.endswith(("lora_A.weight", "lora_B.weight"))
        for n in state
    )
    target, params = _adapted(checkpoint, seed=1)
    load_adapter_state(target, state)
    assert torch.equal(_run(target), _run(source))
    # loaded in place: the parameters an optimizer holds are the ones that changed
    assert all(torch.equal(p, t) for p, t in zip(params, state.values()))
    next(iter(state.values())).add_(1.0)  # a copy: changing it leaves the span alone
    assert torch.equal(_run(target), _run(source))


def test_loading_an_adapter_state_that_does_not_fit_is_rejected(checkpoint):
    span, _ = _adapted(checkpoint)
    state = adapter_state(span)
    name = next(iter(state))
    with pytest.raises(ValueError, match=r"missing \['model.layers.1"):
        load_adapter_state(span, {n: t for n, t in state.items() if n != name})
    with pytest.raises(ValueError, match=f"adapter {name} has shape"):
        load_adapter_state(span, {**state, name: torch.zeros(3, 3)})
    other, _ = _adapted(checkpoint, blocks=(0, 2))
    with pytest.raises(ValueError, match="does not fit blocks 0:2"):
        load_adapter_state(other, state)


def test_the_same_seed_gives_the_same_adapters_for_a_block_whatever_the_span(checkpoint):
    rng = torch.random.get_rng_state()
    first, _ = _adapted(checkpoint, seed=7)
    assert torch.equal(torch.random.get_rng_state(), rng)  # the caller's random stream is left alone
    same, _ = _adapted(checkpoint, seed=7, blocks=(0, 4))
    other, _ = _adapted(checkpoint, seed=8)
    a, b, c = adapter_state(first), adapter_state(same), adapter_state(other)
    assert all(torch.equal(t, b[n]) for n, t in a.items())
    assert not any(torch.equal(t, c[n]) for n, t in a.items() if n.endswith("lora_A.weight"))


def test_cached_steps_through_adapted_blocks_match_one_pass(checkpoint):
    span, _ = _adapted(checkpoint, blocks=(0, 4))
    _randomize(span, seed=4)
    hidden = torch.randn(1, 10, 64, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        full = span(hidden)
        cache = span.new_cache()
        parts = [span(hidden[:, :6], cache=cache, prefix_length=0)]
        for t in range(6, 10):
            parts.append(span(hidden[:, t : t + 1], cache=cache, prefix_length=t))
        assert (full - _span(checkpoint, (0, 4))(hidden)).abs().max() > 1e-2
    # the tolerance of tests/peer/test_blocks.py: cached attention sums in another order than one pass
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=2e-4, rtol=0)


def test_half_precision_spans_get_float32_adapters(checkpoint):
    span, params = _adapted(checkpoint, dtype=torch.bfloat16)
    assert {p.dtype for p in params} == {torch.float32}
    out = _run(span)
    assert out.dtype == torch.bfloat16 and torch.equal(out, _run(_span(checkpoint, dtype=torch.bfloat16)))
    _randomize(span, seed=1)
    assert {t.dtype for t in merged_layer_state(span).values()} == {torch.bfloat16}


def test_targets_that_are_not_linear_layers_are_rejected(checkpoint):
    span = _span(checkpoint)
    with pytest.raises(ValueError, match=r"target names \['qkv_proj'\]"):
        add_lora(span, LoraSettings(target=("q_proj", "qkv_proj")))
    add_lora(span, SETTINGS)
    with pytest.raises(ValueError, match="already have LoRA adapters"):
        add_lora(span, SETTINGS)


@pytest.mark.parametrize(
    "field, value",
    [
        ("rank", 0),
        ("rank", 2.0),
        ("rank", True),
        ("alpha", 0.0),
        ("alpha", float("nan")),
        ("dropout", 1.0),
        ("dropout", -0.1),
        ("target", ()),
        ("target", ["q_proj"]),
        ("target", ("q_proj", "")),
    ],
)
def test_bad_settings_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"LoraSettings.{field} must"):
        LoraSettings(**{field: value})
