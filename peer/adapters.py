"""Named LoRA adapters served beside a span's own weights (`swarmlm peer --adapters NAME=DIR`), chosen per session.

A folder is what peft saves (`PeftModel.save_pretrained`, `swarmlm export --adapter-only`): adapter_config.json and
adapter_model.safetensors. The peer injects peft's LoRA layers under each adapter's name into its own blocks and
loads their tensors, so one copy of the base weights serves every adapter. A request names its adapter
(`pb.Span.adapter`, "" for none); a batch of sessions with different adapters is one forward, each row through its
own adapter: peft's mixed-batch forward, handed the rows' names by a forward pre-hook on each LoRA layer.

What the adapter saves whole (peft's `modules_to_save`: embeddings, final norm, head) is the client's to apply
(client/adapters.py); the record says that the adapter has such modules, so a client without the folder refuses
rather than compute something else.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load
from torch import nn

from protocol.records import ADAPTER_NAME_PATTERN, AdapterInfo
from swarm.models.adapters import adapter_files, folder_digest

if TYPE_CHECKING:
    from peft import LoraConfig

BASE = "__base__"  # peft's name, in a mixed batch, for rows that use no adapter
# a LoRA tensor of a decoder layer, as peft saves it: base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight
_LAYER_TENSOR = re.compile(r"^(?:base_model\.model\.)?(?:.*\.)?layers\.(\d+)\.(.+)\.lora_([AB])\.weight$")
_UNSUPPORTED = {
    "use_dora": "DoRA",
    "lora_bias": "LoRA biases",
    "target_parameters": "adapters on parameters (MoE experts)",
    "layer_replication": "layer replication",
    "trainable_token_indices": "trainable tokens",
}

_rows: contextvars.ContextVar[tuple[str, ...] | None] = contextvars.ContextVar("adapter_rows", default=None)


@dataclass(frozen=True)
class AdapterFolder:
    """One adapter as read from its folder: its settings, its LoRA tensors of decoder layers, what it means."""

    name: str
    path: Path
    config: LoraConfig
    tensors: dict[tuple[int, str, str], torch.Tensor]  # (block, module path in the layer, "A" or "B") -> weight
    digest: str  # of both files' bytes: peers serving the same folder announce the same
    client_modules: bool  # it also replaces modules outside the blocks (modules_to_save), which the client applies


def read_adapter(name: str, path: str | Path) -> AdapterFolder:
    """Read the adapter folder at `path`, served as `name`.

    Raises:
        ValueError: the name is not allowed, the folder is not a peft LoRA adapter in safetensors, or it uses
            something a peer cannot serve (DoRA, LoRA biases, adapters of modules outside the decoder layers).
    """
    if not re.fullmatch(ADAPTER_NAME_PATTERN, name):
        raise ValueError(f"adapter name {name!r} must be 1-64 letters, digits, '_', '.' or '-'")
    path = Path(path)
    config_file, weights_file = adapter_files(path, name)
    from peft import LoraConfig  # peft takes seconds to import; only peers with adapters need it

    try:
        settings = json.loads(config_file.read_bytes())
        config = LoraConfig.from_pretrained(path)
    except Exception as exc:
        raise ValueError(f"adapter {name}: {config_file} is not a LoRA adapter config: {exc}") from exc
    if settings.get("peft_type") != "LORA":
        raise ValueError(f"adapter {name}: {path} is a {settings.get('peft_type')} adapter; peers serve LoRA only")
    for field, what in _UNSUPPORTED.items():
        if settings.get(field):
            raise ValueError(f"adapter {name}: {path} uses {what} ({field}), which peers cannot serve yet")
    tensors, client_modules = {}, False
    weights = weights_file.read_bytes()  # once: for the tensors and for the digest
    for key, tensor in load(weights).items():
        match = _LAYER_TENSOR.match(key)
        if match:
            tensors[int(match[1]), match[2], match[3]] = tensor
        elif ".lora_" in key:
            raise ValueError(
                f"adapter {name}: {key} adapts a module outside the decoder layers, which the swarm cannot apply; "
                f"train adapters of the layers' linear modules only"
            )
        else:
            client_modules = True
    return AdapterFolder(name, path, config, tensors, folder_digest(path, name, weights), client_modules)


def adapter_records(folders: Sequence[AdapterFolder]) -> tuple[AdapterInfo, ...]:
    """What a peer announces of the adapters it serves (protocol/records.py), by name."""
    return tuple(
        AdapterInfo(name=f.name, digest=f.digest, client_modules=f.client_modules)
        for f in sorted(folders, key=lambda f: f.name)
    )


class ServedAdapters:
    """The adapters injected into a span's layers, and the rows of the forward that uses them."""

    def __init__(self, layers: nn.ModuleList, first: int, folders: Sequence[AdapterFolder]):
        """Inject every adapter of `folders` into `layers` (blocks first, first + 1, ...) and load its tensors.

        Raises:
            ValueError: a folder lacks tensors of a block it adapts, or has tensors no layer of the blocks takes.
        """
        from peft.tuners.lora import LoraLayer

        self.folders = {folder.name: folder for folder in folders}
        for folder in folders:
            _inject(layers, first, folder)
        self.modules = [m for m in layers.modules() if isinstance(m, LoraLayer)]
        for module in self.modules:
            module.set_adapter([])  # a forward that names no adapter (outside `rows`) is the base model's
            module.register_forward_pre_hook(_pass_rows, with_kwargs=True)

    def rows(self, names: Sequence[str]) -> contextlib.AbstractContextManager:
        """Compute the forwards inside with row i of the batch through adapter `names[i]` ("": none). A forward run
        between layers by another task sets its own rows, and the outer's are back when it returns.

        Raises:
            ValueError: a name this span does not serve.
        """
        unknown = sorted({name for name in names if name and name not in self.folders})
        if unknown:
            raise ValueError(
                f"no adapter {', '.join(map(repr, unknown))} here; this peer serves {sorted(self.folders)}"
            )
        return _selected(tuple(name or BASE for name in names) if any(names) else None)


@contextlib.contextmanager
def _selected(rows: tuple[str, ...] | None) -> Iterator[None]:
    token = _rows.set(rows)
    try:
        yield
    finally:
        _rows.reset(token)


def _pass_rows(module: nn.Module, args: tuple, kwargs: dict):
    rows = _rows.get()
    if rows is None:
        return None
    return args, {**kwargs, "adapter_names": list(rows)}


def _inject(layers: nn.ModuleList, first: int, folder: AdapterFolder) -> None:
    # named as in the checkpoint (model.layers.12.self_attn.q_proj), so that the adapter's target_modules and
    # layers_to_transform select what they select in the whole model; a fresh root per adapter, so that peft does
    # not take a second adapter on one root for a mistake
    from peft import inject_adapter_in_model
    from peft.tuners.lora import LoraLayer

    root = nn.Module()
    root.model = nn.Module()
    root.model.layers = nn.ModuleDict({str(first + j): layer for j, layer in enumerate(layers)})
    with torch.random.fork_rng(devices=[]):  # peft draws an init that the folder's tensors replace
        inject_adapter_in_model(folder.config, root, adapter_name=folder.name)
    wanted = {
        (first + j, path): module
        for j, layer in enumerate(layers)
        for path, module in layer.named_modules()
        if isinstance(module, LoraLayer) and folder.name in module.lora_A
    }
    blocks = range(first, first + len(layers))
    given = {(block, path) for block, path, _ in folder.tensors if block in blocks}
    if given - set(wanted):
        extra = sorted(f"model.layers.{b}.{p}" for b, p in given - set(wanted))[:3]
        raise ValueError(
            f"adapter {folder.name}: {folder.path} has tensors for {extra}, which its config does not adapt"
        )
    with torch.no_grad():
        for (block, path), module in wanted.items():
            for side, weights in (("A", module.lora_A), ("B", module.lora_B)):
                tensor = folder.tensors.get((block, path, side))
                if tensor is None:
                    raise ValueError(
                        f"adapter {folder.name}: {folder.path} lacks lora_{side} of model.layers.{block}.{path}"
                    )
                weight = weights[folder.name].weight
                if tensor.shape != weight.shape:
                    raise ValueError(
                        f"adapter {folder.name}: lora_{side} of model.layers.{block}.{path} has shape "
                        f"{tuple(tensor.shape)}, the layer takes {tuple(weight.shape)}: it was made for another model"
                    )
                weight.copy_(tensor)
    layers.requires_grad_(False)
