"""`swarmlm export`: the swarm's current weights as a plain Hugging Face checkpoint (client/training/adapters.py
writes a LoRA run's adapters alone, with --adapter-only).

Each span comes from one peer that serves it (LoRA adapters merged in by the peer); the embeddings, norm and
head come from a trainer's `--save` folder, or from the original checkpoint when there is none.
"""

from __future__ import annotations

import argparse
import logging
import shutil
from collections.abc import Mapping
from pathlib import Path

import grpc
import torch
from safetensors.torch import load_file, save_file

from client.config import ClientConfig
from client.loop import BackgroundLoop
from client.sequence import RemoteSequence
from client.transport import ChannelPool
from protocol import swarmlm_pb2 as pb
from protocol.codec import decode_tensor
from protocol.errors import NoPeersError, PeerFaultError, SwarmError, TrainingFaultError
from protocol.records import check_prefix, prefix_for_model
from protocol.service import error_from_rpc
from swarm.dht.node import start_dht, stop_dht
from swarm.models.checkpoint import load_config, load_tensors, resolve_model_path, tensor_shapes
from swarm.trust.rpcauth import call_metadata
from swarm.trust.swarmkey import SWARM_KEY_HELP, SwarmKey, load_optional

logger = logging.getLogger(__name__)

TRAINER_FILE = "trainer.safetensors"
OPTIMIZER_FILE = "optimizer.pt"  # a trainer's update count and optimizer statistics (swarmlm train --save)
_COPIED = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


async def fetch_peer_weights(
    pool: ChannelPool,
    endpoint: str,
    prefix: str,
    start: int,
    end: int,
    expected: Mapping[str, tuple[int, ...]] | None = None,
    adapters: bool = False,
) -> dict[str, torch.Tensor]:
    """The current weights of the span [start, end) that the peer at `endpoint` serves, by checkpoint name (with
    `adapters`, its LoRA run's adapters instead).

    With `expected` (the checkpoint's shapes), the stream is read only as far as those tensors go: a name or a
    shape that is not the checkpoint's, or rows beyond a tensor's, is the peer's fault (PeerFaultError), so a peer
    cannot make its reader hold more than the span's weights.
    """
    request = pb.StateRequest(span=pb.Span(model=prefix, start=start, end=end), adapters=adapters)
    pieces: dict[str, list[torch.Tensor]] = {}
    rows: dict[str, int] = {}
    try:
        stub = await pool.stub_for(endpoint)
        async for part in stub.state(request, timeout=600, metadata=call_metadata(pool.auth, "state")):
            name = part.message.name
            piece = decode_tensor(part.message.tensor, name, part.payload)
            if expected is not None:
                rows[name] = rows.get(name, 0) + (piece.shape[0] if piece.dim() else 1)
                _check_piece(endpoint, name, piece, expected, rows[name])
            pieces.setdefault(name, []).append(piece.clone())
    except grpc.RpcError as exc:
        raise error_from_rpc(exc, endpoint) from exc
    return {name: torch.cat(parts) if len(parts) > 1 else parts[0] for name, parts in pieces.items()}


def _check_piece(endpoint: str, name: str, piece: torch.Tensor, expected: Mapping, rows: int) -> None:
    shape = expected.get(name)
    if shape is None:
        raise PeerFaultError(f"peer {endpoint} sent a tensor {name!r} that the blocks it serves do not have")
    whole = tuple(shape[:1]) if shape else (1,)
    if tuple(piece.shape[1:]) != tuple(shape[1:]) or (piece.dim() == 0) != (len(shape) == 0) or rows > whole[0]:
        raise PeerFaultError(
            f"peer {endpoint} sent {name!r} with {rows} rows of shape {list(piece.shape[1:])} so far; the "
            f"checkpoint's is {list(shape)}"
        )


async def check_stages_agree(sequence: RemoteSequence, run_id: str) -> int:
    """The update every member of every stage of `run_id` is at, once they all agree on it and on their state.

    Raises:
        TrainingFaultError: members of a stage are at different updates, or hold different states (a round under
            way, or a member that diverged): exporting then would mix weights of different updates.
    """
    from client.training.stages import INFO_TIMEOUT_S, Stages

    stages = await Stages(sequence, run_id).members()
    if not stages:
        raise NoPeersError(f"no peer trains run {run_id!r}; start peers with --train --run-id {run_id}")
    seen: dict[tuple[int, str], list[str]] = {}
    for span, members in sorted(stages.items()):
        for pid, member in members.items():
            info = await sequence.pool.unary(member.address, "info", pb.InfoRequest(param_digest=True), INFO_TIMEOUT_S)
            seen.setdefault((int(info.epoch), info.param_digest), []).append(f"{span[0]}:{span[1]} {pid[-8:]}")
        by_stage = {key for key, who in seen.items() if any(w.startswith(f"{span[0]}:{span[1]} ") for w in who)}
        if len(by_stage) > 1:
            detail = "; ".join(f"update {e} digest {d[:12]}: {', '.join(who)}" for (e, d), who in seen.items())
            raise TrainingFaultError(
                f"the members of stage {span[0]}:{span[1]} of run {run_id!r} disagree ({detail}); export once the "
                f"run has settled (between steps), or leave out the peer that diverged"
            )
    epochs = {epoch for epoch, _ in seen}
    if len(epochs) > 1:
        raise TrainingFaultError(
            f"the stages of run {run_id!r} are at different updates {sorted(epochs)}; export between steps"
        )
    return epochs.pop()


async def fetch_span_weights(
    sequence: RemoteSequence,
    start: int,
    end: int,
    shapes: Mapping[str, tuple[int, ...]] | None = None,
    adapters: bool = False,
) -> dict[str, torch.Tensor]:
    """Weights of blocks [start, end) (or, with `adapters`, a LoRA run's adapters) from peers of the sequence's run,
    one peer per span it covers; with `shapes` (the checkpoint's), each peer's stream is held to them."""
    tensors: dict[str, torch.Tensor] = {}
    route = await sequence.plan(start, end, inference=False, refresh=True)
    snapshot = await sequence.snapshot()
    for hop in route:
        info = snapshot.servers[hop.peer_id]
        expected = None
        if shapes is not None:
            blocks = tuple(f"model.layers.{i}." for i in range(info.start_block, info.end_block))
            expected = {name: shape for name, shape in shapes.items() if name.startswith(blocks)}
        weights = await fetch_peer_weights(
            sequence.pool, hop.endpoint, sequence.prefix, info.start_block, info.end_block, expected, adapters
        )
        wanted = {f"model.layers.{i}." for i in range(hop.start, hop.end)}
        tensors.update({name: t for name, t in weights.items() if any(name.startswith(w) for w in wanted)})
    return tensors


def export_model(
    model: str,
    initial_peers: list[str],
    out: str | Path,
    *,
    trainer_dir: str | Path | None = None,
    run_id: str | None = None,
    dht_prefix: str | None = None,
    swarm_key: SwarmKey | None = None,
) -> Path:
    """Write the swarm's current weights of `model` to `out` as a checkpoint transformers loads.

    Args:
        model: the checkpoint folder the peers were started with (its config and tokenizer are copied).
        trainer_dir: a trainer's `--save` folder with the trained embeddings, norm and head.
        run_id: take the blocks from peers training this run, whose stages must agree on their update and
            state (None: from peers that do not train, so that no run's half-updated weights are mixed in).

    Raises:
        TrainingFaultError: the run's stages disagree, or the trainer's saved update is not theirs.
        NoPeersError: no peer (of the run) serves some blocks.
    """
    path = resolve_model_path(model)
    config = load_config(path)
    prefix = check_prefix(dht_prefix or prefix_for_model(model))
    loop, dht = BackgroundLoop(), start_dht(initial_peers, client_mode=True, swarm_key=swarm_key)
    try:
        sequence = RemoteSequence(
            dht,
            prefix,
            config.num_hidden_layers,
            ClientConfig(initial_peers=tuple(initial_peers), swarm_key=swarm_key),
            run_id=run_id if run_id is not None else "",  # "": only peers that train no run
        )
        try:
            epoch = loop.run(check_stages_agree(sequence, run_id)) if run_id is not None else None
            shapes = tensor_shapes(path, lambda name: name.startswith("model.layers."))
            tensors = loop.run(fetch_span_weights(sequence, 0, config.num_hidden_layers, shapes))
        finally:
            loop.run(sequence.close())
    finally:
        stop_dht(dht)
        loop.close()
    if trainer_dir is not None:
        local = load_trainer_save(Path(trainer_dir), epoch)
    else:
        local = load_tensors(path, lambda name: not name.startswith("model.layers."), dtype=None)
    tensors.update(local)
    if getattr(config, "tie_word_embeddings", False):
        tensors.pop("lm_head.weight", None)
    served = {int(name.split(".")[2]) for name in tensors if name.startswith("model.layers.")}
    missing = [i for i in range(config.num_hidden_layers) if i not in served]
    if missing:
        raise NoPeersError(f"no weights came for blocks {missing}; start peers serving them")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"), metadata={"format": "pt"}
    )
    for name in _COPIED:
        if (path / name).exists():
            shutil.copy(path / name, out / name)
    logger.info("exported %d tensors to %s", len(tensors), out)
    return out


def load_trainer_save(trainer_dir: Path, epoch: int | None) -> dict[str, torch.Tensor]:
    """A trainer's `--save` tensors (embeddings, norm, head), checked to be at the run's update `epoch` if given.

    Raises:
        TrainingFaultError: the save is of another update than the stages'.
    """
    saved = trainer_dir / OPTIMIZER_FILE
    if epoch is not None and saved.exists():
        trainer_epoch = int(torch.load(saved, weights_only=True)["epoch"])
        if trainer_epoch != epoch:
            raise TrainingFaultError(
                f"the trainer's save in {trainer_dir} is at update {trainer_epoch}, the run's stages at {epoch}: "
                f"they would not make one model; export with the trainer's save of that update"
            )
    return load_file(str(trainer_dir / TRAINER_FILE))


def build_parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Save the swarm's current weights as a Hugging Face checkpoint.")
    p.add_argument("model", help="the checkpoint folder the peers were started with")
    p.add_argument("--initial-peers", nargs="+", required=True, metavar="MADDR", help="multiaddrs to join through")
    p.add_argument("--out", required=True, help="folder to write the checkpoint to")
    p.add_argument("--trainer-dir", help="a `swarmlm train --save` folder with the trained embeddings and head")
    p.add_argument("--run-id", help="take blocks from peers of this training run (default: any peer)")
    p.add_argument("--dht-prefix", help="name of the model in the DHT (default: derived from MODEL)")
    p.add_argument("--swarm-key", metavar="FILE", help=SWARM_KEY_HELP)
    p.add_argument(
        "--adapter-only",
        action="store_true",
        help="write a LoRA run's adapters (with --trainer-dir, its embeddings and head too) as a peft adapter folder, "
        "not the whole model; needs --run-id",
    )
    return p


def run(args: argparse.Namespace) -> int:
    try:
        swarm_key = load_optional(args.swarm_key)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    if args.adapter_only and args.run_id is None:
        raise SystemExit("error: --adapter-only needs --run-id: adapters belong to a LoRA training run")
    try:
        if args.adapter_only:
            from client.training.adapters import export_adapter as export
        else:
            export = export_model
        out = export(
            args.model,
            args.initial_peers,
            args.out,
            trainer_dir=args.trainer_dir,
            run_id=args.run_id,
            dht_prefix=args.dht_prefix,
            swarm_key=swarm_key,
        )
    except (SwarmError, ValueError, OSError) as exc:
        logger.error("%s", exc)
        return 1
    print(f"exported to {out}")
    return 0
