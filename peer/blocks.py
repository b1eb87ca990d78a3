"""Load a span of transformer blocks straight from a checkpoint and run it.

The blocks are the family's own transformers decoder-layer class (LlamaDecoderLayer, Qwen3DecoderLayer, ...),
built on the meta device and filled with only their tensors, so a peer never holds the whole model.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForCausalLM, PretrainedConfig
from transformers.cache_utils import DynamicCache, get_layer_types_and_kwargs
from transformers.conversion_mapping import get_checkpoint_conversion_mapping, get_model_conversion_mapping
from transformers.core_model_loading import convert_and_load_state_dict_in_model
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.modeling_utils import LoadStateDictConfig

from peer.adapters import ServedAdapters
from peer.experts import ExpertCaches, attach
from peer.offload import ALIGNMENT, Store, Streamer, block_bytes, take_out
from peer.quantize import quantize_linears
from protocol.errors import BadRequestError, ModelNotFoundError
from protocol.vocab import Quantization
from swarm.models import ends
from swarm.models.checkpoint import attention_for, checkpoint_dtype, family_class, load_tensors
from swarm.models.routers import RouterStats, recording
from swarm.progress import progress

logger = logging.getLogger(__name__)

LAYER_PREFIX = "model.layers."
_MASK_MAKERS = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}


def layer_types(config: PretrainedConfig) -> list[str]:
    """Attention type per layer, by the rule the model's KV cache uses (Mistral: sliding if `sliding_window`)."""
    types, _ = get_layer_types_and_kwargs(config)
    unknown = sorted(set(types) - set(_MASK_MAKERS))
    if unknown:
        raise ModelNotFoundError(f"layer types {unknown} are not supported yet (only {sorted(_MASK_MAKERS)})")
    return types


def resolve_dtype(config: PretrainedConfig, dtype: str) -> torch.dtype:
    if dtype == "auto":
        return checkpoint_dtype(config)
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


class BlockSpan(nn.Module):
    """Blocks [start, end) of a model, with the model's rotary embedding and mask rules."""

    def __init__(
        self,
        config: PretrainedConfig,
        start: int,
        end: int,
        layers: nn.ModuleList,
        rotary: nn.Module,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | None = None,
        streamer: Streamer | None = None,
    ):
        super().__init__()
        self.config, self.start, self.end = config, start, end
        self.layers, self.rotary = layers, rotary
        first = next(layers.parameters(), None) if dtype is None or device is None else None
        # given by load_span: a streamed block's module holds meta tensors while it is out
        self.dtype = dtype or first.dtype
        self.device = device or first.device
        self.streamer = streamer  # None: every block resident (else peer/offload.py streams some in)
        self.quantization = Quantization.NONE  # how its linear weights are held (set by load_span)
        self.adapters: ServedAdapters | None = None  # named LoRA adapters beside its weights (peer/adapters.py)
        self.expert_caches: ExpertCaches | None = None  # experts kept off the device but N a layer (peer/experts.py)
        types = layer_types(config)
        self.types = types[start:end]
        # Gemma 3's rotary embedding differs by attention type (another base frequency for its sliding layers)
        self._typed_rotary = "layer_type" in inspect.signature(rotary.forward).parameters

    def position_embeddings(self, states: torch.Tensor, position_ids: torch.Tensor, types: Sequence[str]) -> dict:
        """The rotary embedding of `position_ids` for each attention type among `types`, as the model computes it."""
        if not self._typed_rotary:
            shared = self.rotary(states, position_ids)
            return dict.fromkeys(set(types), shared)
        return {kind: self.rotary(states, position_ids, kind) for kind in set(types)}

    def layer(self, index: int) -> nn.Module:
        """Block `index`'s module with its weights in (a streamed block is loaded now: call it right before use)."""
        if self.streamer is not None:
            return self.streamer.layer(index)
        return self.layers[index - self.start]

    def close(self) -> None:
        """Stop streaming blocks in and remove their stored copies, and the experts' files (a span that keeps
        everything in memory has nothing to do)."""
        if self.streamer is not None:
            self.streamer.close()
        if self.expert_caches is not None:
            self.expert_caches.close()

    def new_cache(self) -> DynamicCache:
        return DynamicCache(config=self.config)

    def adapter_rows(self, adapter: str | Sequence[str] | None, batch: int) -> contextlib.AbstractContextManager:
        """The forwards inside compute row i through adapter `adapter[i]` (one name: every row; "" or None: none).

        Raises:
            BadRequestError: an adapter this span does not serve.
        """
        if self.adapters is None and not adapter:  # the common case, on every forward: nothing to build
            return contextlib.nullcontext()
        names = [adapter or ""] * batch if adapter is None or isinstance(adapter, str) else list(adapter)
        if self.adapters is None:
            if any(names):
                raise BadRequestError(f"blocks {self.start}:{self.end} are served without adapters")
            return contextlib.nullcontext()
        try:
            return self.adapters.rows(names)
        except ValueError as exc:
            raise BadRequestError(str(exc)) from exc

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: DynamicCache | None = None,
        prefix_length: int = 0,
        blocks: tuple[int, int] | None = None,
        between_layers: Callable[[], None] | None = None,
        adapter: str | None = None,
        routers: RouterStats | None = None,
    ) -> torch.Tensor:
        """Run blocks `blocks` (default: all of the span) on hidden states of shape [batch, seq, hidden].

        `prefix_length` tokens are already in `cache`; `attention_mask` covers prefix + new tokens.
        `between_layers` is called between layers, in the forward and (when it builds a graph) in its backward:
        see peer/compute.py. `adapter`: the named LoRA adapter to compute with (peer/adapters.py); None: none.
        `routers`: where to add the routed layers' sums (swarm/models/routers.py); None: nowhere.
        """
        with self.adapter_rows(adapter, hidden_states.shape[0]):
            return self._forward(
                hidden_states, attention_mask, position_ids, cache, prefix_length, blocks, between_layers, routers
            )

    def _forward(
        self, hidden_states, attention_mask, position_ids, cache, prefix_length, blocks, between_layers, routers
    ):
        start, end = blocks or (self.start, self.end)
        types = self.types[start - self.start : end - self.start]
        # masks are sized against the first cache layer of each attention type among the blocks run
        first_of_type = {kind: start + types.index(kind) for kind in set(types)}
        device = self.device
        hidden_states = hidden_states.to(device)
        attention_mask = attention_mask.to(device) if attention_mask is not None else None
        if position_ids is None:
            position_ids = torch.arange(prefix_length, prefix_length + hidden_states.shape[1]).unsqueeze(0)
        position_ids = position_ids.to(device)
        masks = {
            kind: _MASK_MAKERS[kind](
                config=self.config,
                inputs_embeds=hidden_states,
                attention_mask=attention_mask,
                cache=cache,
                position_ids=position_ids,
                layer_idx=first if cache is not None else None,
            )
            for kind, first in first_of_type.items()
        }
        position_embeddings = self.position_embeddings(hidden_states, position_ids, types)
        for index, kind in enumerate(types):
            if between_layers is not None and index:
                between_layers()
                if hidden_states.requires_grad:  # the backward passes here too
                    hidden_states.register_hook(lambda grad: between_layers())
            if self.expert_caches is not None:
                self.expert_caches.before(start + index, hidden_states)
            layer = self.layer(start + index)
            with recording(layer, routers, self.config):
                hidden_states = layer(
                    hidden_states,
                    attention_mask=masks[kind],
                    position_ids=position_ids,
                    cache=cache,
                    use_cache=cache is not None,
                    position_embeddings=position_embeddings[kind],
                )
        return hidden_states


def rewind_cache(cache: DynamicCache, length: int) -> None:
    """Forget every token after the first `length` in each layer (after a failed step, layers may differ).

    Raises BadRequestError where that is impossible: a sliding-window layer past its window no longer holds
    the states to go back to.
    """
    for layer in cache.layers:
        extra = layer.get_seq_length() - length
        if extra <= 0:
            continue
        try:
            layer.crop(-extra)  # transformers' crop takes the number of tokens to remove, as a negative int
        except RuntimeError as exc:
            raise BadRequestError(
                f"cannot go back to {length} tokens: a sliding-window layer keeps only its last "
                f"{getattr(layer, 'sliding_window', '?')} tokens; replay the sequence in a new session"
            ) from exc


def load_span(
    path: Path,
    config: PretrainedConfig,
    start: int,
    end: int,
    *,
    dtype: torch.dtype,
    device: torch.device,
    quantization: Quantization = Quantization.NONE,
    stream: tuple[int, Store] | None = None,
    experts: ExpertCaches | None = None,
) -> BlockSpan:
    """Build blocks [start, end) from the checkpoint at `path`, one block at a time, reading only its tensors; with
    `quantization`, each block's linear layers are quantized as it is built (peer/quantize.py). With `stream`
    (resident blocks, store), the blocks after the first `resident` go to the store as they are built and are
    streamed in when they compute (peer/offload.py). With `experts`, each block's experts go to that cache as the block
    is built (peer/experts.py), and the span is given the cache."""
    if not 0 <= start < end <= config.num_hidden_layers:
        raise ValueError(f"blocks {start}:{end} are outside the model's 0:{config.num_hidden_layers}")
    ends.check_ends(config)
    config._attn_implementation = attention_for(config)
    rotary_cls = family_class(config, "RotaryEmbedding")
    converted = bool(get_checkpoint_conversion_mapping(config.model_type))
    total_bytes = sum(block_bytes(path, config, start, end, dtype))
    layers = []
    with progress(
        total=total_bytes,
        desc=f"loading blocks {start}:{end}",
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        leave=False,
    ) as bar:
        for i in range(start, end):
            # one block's tensors at a time: loading peaks at one block beyond what the span keeps
            prefix = f"{LAYER_PREFIX}{i}."
            tensors = load_tensors(path, lambda name, prefix=prefix: name.startswith(prefix), dtype=dtype)
            loaded = sum(t.numel() * t.element_size() for t in tensors.values())
            if converted:
                layer = _converted_layers(path, config, i, i + 1, tensors, dtype)[0]
            else:
                layer = _layer(path, config, i, tensors)
            if experts is not None:  # before the block goes to the device: its experts never all go there
                experts.add(i, layer)
            layer = layer.to(device=device, dtype=dtype)
            if quantization != Quantization.NONE:
                quantize_linears(layer, quantization)
            _own_copies(layer, misaligned_only=quantization == Quantization.NONE)
            if stream is not None and i - start >= stream[0]:
                take_out(stream[1], i, layer)
            layers.append(layer)
            bar.set_postfix_str(f"block {i + 1 - start}/{end - start}", refresh=False)
            bar.update(loaded)
    streamer = None if stream is None else Streamer(layers, start, *stream)
    rotary = rotary_cls(config=config).to(device)
    span = BlockSpan(
        config, start, end, nn.ModuleList(layers), rotary, dtype=dtype, device=device, streamer=streamer
    ).eval()
    span.requires_grad_(False)
    span.quantization = quantization
    if experts is not None:
        attach(span, experts)
    return span


def _own_copies(module: nn.Module, misaligned_only: bool = False) -> None:
    """Give `module`'s remaining parameters (norms, biases) memory of their own. Tensors read from a checkpoint map
    its whole file, and one small norm kept from a mapping keeps every page read through it resident: a quantized
    block would otherwise hold the full-precision weights it was quantized from.

    `misaligned_only`: only those whose memory is not aligned (offload.ALIGNMENT: transformers' conversion of MoE
    checkpoints leaves some at the file's offsets), so that a resident block computes exactly what the same block
    streamed in does."""
    for owner in module.modules():
        for name, param in list(owner.named_parameters(recurse=False)):
            if not misaligned_only or param.data_ptr() % ALIGNMENT:
                setattr(owner, name, nn.Parameter(param.detach().clone(), requires_grad=param.requires_grad))


def _layer(path: Path, config: PretrainedConfig, i: int, tensors: dict[str, torch.Tensor]) -> nn.Module:
    """Block `i`, its checkpoint tensors taken as they are named in the family's decoder-layer class."""
    prefix = f"{LAYER_PREFIX}{i}."
    # taken out of `tensors`: once the block holds them, nothing else does (a quantized block then frees them)
    state = {name[len(prefix) :]: tensors.pop(name) for name in list(tensors) if name.startswith(prefix)}
    with torch.device("meta"):
        layer = family_class(config, "DecoderLayer")(config, layer_idx=i)
    missing = set(layer.state_dict()) - set(state)
    if missing:
        raise ModelNotFoundError(f"checkpoint {path} lacks tensors of block {i}: {sorted(missing)[:5]}")
    layer.load_state_dict(state, strict=True, assign=True)
    return layer


def _converted_layers(
    path: Path, config: PretrainedConfig, start: int, end: int, tensors: dict[str, torch.Tensor], dtype: torch.dtype
) -> list[nn.Module]:
    """Blocks [start, end) of a family whose checkpoint names differ from its modules' (transformers 5 fuses the
    experts of Mixtral and Qwen-MoE checkpoints on load): transformers' own conversion fills a model built on the
    meta device, whose other blocks, embeddings and head stay empty."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    info, _ = convert_and_load_state_dict_in_model(
        model,
        tensors,
        LoadStateDictConfig(device_map={"": "cpu"}, dtype=dtype, weight_mapping=get_model_conversion_mapping(model)),
    )
    mismatched = sorted(name for name, *_ in info.mismatched_keys)
    if mismatched:
        raise ModelNotFoundError(f"checkpoint {path} has tensors of the wrong shape for the config: {mismatched[:5]}")
    layers = [model.model.layers[i] for i in range(start, end)]
    for i, layer in zip(range(start, end), layers):
        missing = sorted(name for name, t in layer.state_dict().items() if t.is_meta)
        if missing:
            raise ModelNotFoundError(f"checkpoint {path} lacks tensors of block {i}: {missing[:5]}")
    return layers
