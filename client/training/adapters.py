"""`swarmlm export --adapter-only`: a LoRA run's adapters as a peft adapter folder.

Each span's adapters come from one peer of the run (unmerged: `model.layers.3.self_attn.q_proj.lora_A.weight`), the
stages agreeing on their update as for a full export. They are written as peft saves an adapter: the checkpoint name
under `base_model.model.`, beside an `adapter_config.json` with the run's rank and alpha and the layers that carry
adapters. The trainer's embeddings, final norm and head (a `swarmlm train --save` folder), which every run trains
in full, go in as peft's `modules_to_save`. So `PeftModel.from_pretrained(base, folder)` computes what the swarm
serves, with no full copy of the model written.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from safetensors.torch import save_file

from client.config import ClientConfig
from client.loop import BackgroundLoop
from client.sequence import RemoteSequence
from client.training.export import TRAINER_FILE, check_stages_agree, fetch_span_weights, load_trainer_save
from protocol.errors import BadRequestError, NoPeersError, PeerFaultError
from protocol.records import check_prefix, prefix_for_model
from protocol.vocab import TrainMode
from swarm.dht.node import start_dht, stop_dht
from swarm.models.checkpoint import load_config, resolve_model_path, tensor_shapes
from swarm.models.ends import LOCAL_PREFIXES
from swarm.training.recipe import read_recipe
from swarm.trust.swarmkey import SwarmKey

logger = logging.getLogger(__name__)

ADAPTER_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # where peft's saved adapters put the base model's names


def adapter_shapes(shapes: dict[str, tuple[int, ...]], rank: int) -> dict[str, tuple[int, ...]]:
    """The shape of every adapter a block's linear layer may carry, by name: A is [rank, in], B is [out, rank]."""
    expected = {}
    for name, shape in shapes.items():
        if name.startswith("model.layers.") and name.endswith(".weight") and len(shape) == 2:
            layer = name.removesuffix(".weight")
            expected[f"{layer}.lora_A.weight"] = (rank, shape[1])
            expected[f"{layer}.lora_B.weight"] = (shape[0], rank)
    return expected


def _targets(adapters: dict[str, torch.Tensor], num_blocks: int) -> list[str]:
    """The layer names (`q_proj`, ...) that carry adapters, the same in every block and each with A and B."""
    by_block: dict[int, set[str]] = {}
    for name in adapters:
        layer = name.removesuffix(".lora_A.weight").removesuffix(".lora_B.weight")
        by_block.setdefault(int(name.split(".")[2]), set()).add(layer.split(".", 3)[3])
    missing = [i for i in range(num_blocks) if i not in by_block]
    if missing:
        raise NoPeersError(f"no adapters came for blocks {missing}; start LoRA peers of the run serving them")
    targets = by_block[0]
    for block, layers in by_block.items():
        pairs = all(f"model.layers.{block}.{layer}.lora_{ab}.weight" in adapters for layer in layers for ab in "AB")
        if layers != targets or not pairs:
            raise PeerFaultError(
                f"block {block}'s adapters ({sorted(layers)}) are not block 0's ({sorted(targets)}) or lack A or B"
            )
    return sorted({layer.rsplit(".", 1)[-1] for layer in targets})


def export_adapter(
    model: str,
    initial_peers: list[str],
    out: str | Path,
    *,
    run_id: str,
    trainer_dir: str | Path | None = None,
    dht_prefix: str | None = None,
    swarm_key: SwarmKey | None = None,
) -> Path:
    """Write LoRA run `run_id`'s adapters (and a trainer's embeddings, norm and head) to `out` as peft does.

    Raises:
        BadRequestError: the run trains full weights (export it without --adapter-only), or has no recipe.
        TrainingFaultError: the run's stages disagree, or the trainer's saved update is not theirs.
        NoPeersError: no peer of the run serves some blocks.
    """
    path = resolve_model_path(model)
    config = load_config(path)
    prefix = check_prefix(dht_prefix or prefix_for_model(model))
    loop, dht = BackgroundLoop(), start_dht(initial_peers, client_mode=True, swarm_key=swarm_key)
    try:
        recipe = read_recipe(dht, prefix, run_id)
        if recipe is None:
            raise BadRequestError(f"run {run_id!r} of {prefix} has no recipe in the swarm: is it the right run id?")
        if recipe.train_mode != TrainMode.LORA:
            raise BadRequestError(
                f"run {run_id!r} trains full weights, not LoRA adapters: export it without --adapter-only"
            )
        sequence = RemoteSequence(
            dht,
            prefix,
            config.num_hidden_layers,
            ClientConfig(initial_peers=tuple(initial_peers), swarm_key=swarm_key),
            run_id=run_id,
        )
        try:
            epoch = loop.run(check_stages_agree(sequence, run_id))
            expected = adapter_shapes(tensor_shapes(path, lambda n: n.startswith("model.layers.")), recipe.lora_rank)
            adapters = loop.run(fetch_span_weights(sequence, 0, config.num_hidden_layers, expected, adapters=True))
        finally:
            loop.run(sequence.close())
    finally:
        stop_dht(dht)
        loop.close()
    tied = bool(getattr(config, "tie_word_embeddings", False))
    trainer = _trainer_tensors(Path(trainer_dir), epoch, tied=tied) if trainer_dir is not None else None
    out = write_adapter(
        out, adapters, trainer, rank=recipe.lora_rank, alpha=recipe.lora_alpha, base_model=path,
        num_blocks=config.num_hidden_layers, tied=tied,
    )  # fmt: skip
    logger.info("exported the adapters of run %r (update %d) to %s", run_id, epoch, out)
    return out


def write_adapter(
    out: str | Path,
    adapters: dict[str, torch.Tensor],
    trainer: dict[str, torch.Tensor] | None,
    *,
    rank: int,
    alpha: float,
    base_model: str | Path,
    num_blocks: int,
    tied: bool,
) -> Path:
    """Write `adapters` (checkpoint-style names, every block's) and the `trainer`'s embeddings, norm and head (as
    peft's `modules_to_save`; None: leave them out) to `out` as peft saves an adapter. `tied`: the model's head is
    its embeddings (then peft must tie the trained copy too, or the head stays the checkpoint's)."""
    from peft import LoraConfig

    targets = _targets(adapters, num_blocks)
    tensors = {PEFT_PREFIX + name: t for name, t in adapters.items()}
    modules_to_save = None
    if trainer is not None:
        if tied:  # peft ties its trained copies of both, and loads each from the file
            trainer = {**trainer, "lm_head.weight": trainer["model.embed_tokens.weight"].clone()}
        tensors.update({PEFT_PREFIX + name: t for name, t in trainer.items()})
        # peft matches these by suffix: "model.norm", not "norm", which every block's layer norms end with too
        modules_to_save = sorted({name.rsplit(".", 1)[0].removeprefix("model.") for name in trainer})
        modules_to_save = ["model.norm" if m == "norm" else m for m in modules_to_save]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    LoraConfig(
        r=rank,
        lora_alpha=alpha,
        lora_dropout=0.0,
        target_modules=targets,
        modules_to_save=modules_to_save,
        bias="none",
        task_type="CAUSAL_LM",
        base_model_name_or_path=str(base_model),
        ensure_weight_tying=tied and trainer is not None,
    ).save_pretrained(str(out))
    tensors = {k: v.detach().contiguous() for k, v in tensors.items()}
    save_file(tensors, str(out / ADAPTER_FILE), metadata={"format": "pt"})
    return out


def read_adapter(folder: str | Path) -> dict[str, torch.Tensor]:
    """The tensors of an adapter folder `write_adapter` wrote, by checkpoint-style name (peft's prefix removed).

    Raises:
        ValueError: the folder holds no adapter file.
    """
    from safetensors.torch import load_file

    file = Path(folder) / ADAPTER_FILE
    if not file.is_file():
        raise ValueError(f"{folder} holds no {ADAPTER_FILE}: is it a LoRA run's save?")
    return {name.removeprefix(PEFT_PREFIX): t for name, t in load_file(str(file)).items()}


def _trainer_tensors(trainer_dir: Path, epoch: int, tied: bool) -> dict[str, torch.Tensor]:
    """The embeddings, final norm and head of a trainer's save, checked to be at the stages' update `epoch`."""
    tensors = load_trainer_save(trainer_dir, epoch)
    if tied:
        tensors.pop("lm_head.weight", None)
    unknown = sorted(name for name in tensors if not name.startswith(LOCAL_PREFIXES))
    if unknown:
        raise BadRequestError(f"{trainer_dir / TRAINER_FILE} holds {unknown[:3]}, not a trainer's embeddings and head")
    return tensors
