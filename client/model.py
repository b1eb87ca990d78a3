"""A causal LM whose blocks live in the swarm: embeddings, final norm and LM head stay local.

It is a transformers PreTrainedModel with GenerationMixin, so `generate()` (greedy, sampling,
repetition penalty, stopping criteria, streamers) is Hugging Face's own; only the blocks are remote. With
transformers' assisted-generation arguments (`prompt_lookup_num_tokens`, `assistant_model`) it decodes
speculatively instead, several tokens per trip through the swarm (client/speculative.py).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import logging
from collections.abc import Iterator

import torch
from torch import nn
from transformers import GenerationConfig, GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.loss.loss_utils import ForCausalLMLoss
from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast

from client import speculative
from client.config import ClientConfig
from client.loop import BackgroundLoop
from client.remote_blocks import RemoteBlocks
from client.sequence import RemoteSequence
from client.session import InferenceSession
from protocol.errors import BadRequestError, ModelNotFoundError, OutputRewoundError
from protocol.records import check_prefix, prefix_for_model
from swarm.dht.node import start_dht, stop_dht
from swarm.models import ends
from swarm.models.adapters import whole_modules
from swarm.models.checkpoint import checkpoint_dtype, load_config, load_tensors, resolve_model_path
from swarm.models.routers import MoeLayout, balance_loss, moe_layout

logger = logging.getLogger(__name__)


class _LocalParts(nn.Module):
    """Named like the checkpoint's `model.` prefix so its tensors load by name (the final norm by its family's name)."""

    def __init__(self, embed_tokens: nn.Module, norm_name: str, norm: nn.Module):
        super().__init__()
        self.embed_tokens = embed_tokens
        self.norm_name = norm_name
        self.add_module(norm_name, norm)

    @property
    def final_norm(self) -> nn.Module:
        return getattr(self, self.norm_name)


class ClientSession:
    """What `inference_session()` yields: the position reached and the server-side sessions behind it."""

    def __init__(self, model: DistributedModelForCausalLM, max_length: int):
        self.model, self.max_length = model, max_length
        self.remote: InferenceSession | None = None  # opened at the first step, when the batch size is known
        self.token_ids: torch.Tensor | None = None  # tokens already sent, to recognise a repeated prefix

    @property
    def position(self) -> int:
        return self.remote.position if self.remote is not None else 0

    @property
    def recoveries(self) -> int:
        return self.remote.recoveries if self.remote is not None else 0

    def close(self) -> None:
        if self.remote is not None:
            self.model._run(self.remote.close())


class DistributedModelForCausalLM(PreTrainedModel, GenerationMixin):
    """Use like a transformers causal LM; see `AutoDistributedModelForCausalLM.from_pretrained`."""

    base_model_prefix = "model"
    _supports_sdpa = True

    def __init__(self, config: PretrainedConfig):
        super().__init__(config)
        embed_tokens, norm_name, norm, self.lm_head = ends.family_ends(config)
        self.model = _LocalParts(embed_tokens, norm_name, norm)
        self.moe: MoeLayout | None = moe_layout(config)  # a mixture-of-experts model's routed blocks
        self.sequence: RemoteSequence | None = None
        self._loop: BackgroundLoop | None = None
        self._dht = None
        self._session: ClientSession | None = None

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # the KV cache lives on the peers; generate() needs none here

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def local_tensors(self) -> dict[str, torch.Tensor]:
        """The tensors held here (embeddings, final norm, head), by checkpoint name; the head once, as
        `lm_head.weight`, even when tied to the embeddings."""
        tensors = {f"model.{name}": t for name, t in self.model.state_dict(keep_vars=True).items()}
        return {**tensors, **{f"lm_head.{name}": t for name, t in self.lm_head.state_dict(keep_vars=True).items()}}

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The hidden states block 0 takes for `input_ids`, as the model's forward computes them."""
        return ends.scale_embeddings(self.config, self.model.embed_tokens(input_ids))

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The logits of the last block's `hidden` states: final norm, LM head, and what the family adds."""
        return ends.finish_logits(self.config, self.lm_head(self.model.final_norm(hidden)))

    # --- construction ---

    @classmethod
    def from_pretrained(
        cls,
        model: str,
        *,
        initial_peers: list[str] | tuple[str, ...],
        dht_prefix: str | None = None,
        dtype: torch.dtype | str = "auto",
        **client_options,
    ) -> DistributedModelForCausalLM:
        """Load embeddings, final norm and LM head of `model`, and join the swarm serving its blocks.

        Args:
            model: a checkpoint folder or a hub id in the local cache (the same name the peers were given,
                or pass `dht_prefix`).
            initial_peers: multiaddrs to join the DHT through.
            dtype: dtype of the local parts ("auto": the checkpoint's).
            client_options: fields of ClientConfig (request_timeout_s, max_retries, ...).
        """
        config_options = ClientConfig(initial_peers=tuple(initial_peers), dht_prefix=dht_prefix, **client_options)
        path = resolve_model_path(model)
        config = load_config(path)
        if isinstance(dtype, str):
            dtype = checkpoint_dtype(config) if dtype == "auto" else getattr(torch, dtype)
        with torch.device("meta"):
            instance = cls(config)  # a family whose ends no client computes is refused here (ends.family_ends)
        local_names = set(instance.local_tensors())
        tensors = load_tensors(path, lambda name: name in local_names, dtype=dtype)
        if config_options.adapter_path is not None:  # what the adapter replaces whole (swarm/models/adapters.py)
            tensors.update(_adapter_modules(config_options, dtype, local_names))
        tied = getattr(config, "tie_word_embeddings", False) or "lm_head.weight" not in tensors
        if tied:
            tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
        missing = local_names - set(tensors)
        if missing:
            raise ModelNotFoundError(f"checkpoint {path} lacks {sorted(missing)}")
        instance.load_state_dict(tensors, strict=True, assign=True)
        if tied:
            instance.lm_head.weight = instance.model.embed_tokens.weight
        ends.restore_buffers(instance.model.embed_tokens)
        instance.to(dtype).eval()
        try:
            instance.generation_config = GenerationConfig.from_pretrained(path)
        except OSError:
            instance.generation_config = GenerationConfig.from_model_config(config)
        prefix = check_prefix(dht_prefix or prefix_for_model(model))
        instance._connect(config_options, prefix)
        return instance

    def _connect(self, options: ClientConfig, prefix: str) -> None:
        self._loop = BackgroundLoop()
        self._dht = start_dht(options.initial_peers, client_mode=True, swarm_key=options.swarm_key)
        self.sequence = RemoteSequence(
            self._dht,
            prefix,
            self.config.num_hidden_layers,
            options,
            hidden_size=self.config.hidden_size,
            max_positions=self.config.max_position_embeddings,
        )

    def _run(self, coro):
        return self._loop.run(coro)

    def submit(self, coro) -> concurrent.futures.Future:
        """Run `coro` on this model's event loop, where its remote blocks' coroutines live (client/sequence.py), and
        return its future: for work built on the model's sequence, such as a trainer's step (client/training/)."""
        if self._loop is None:
            raise RuntimeError("this model is not connected to a swarm (shut down, or not made by from_pretrained)")
        return self._loop.submit(coro)

    def shutdown(self) -> None:
        """Close sessions, channels and the DHT node. Safe to call more than once."""
        if self._session is not None:
            self._session.close()
            self._session = None
        if self.sequence is not None:
            self._run(self.sequence.close())
            self.sequence = None
        if self._dht is not None:
            stop_dht(self._dht)
            self._dht = None
        if self._loop is not None:
            self._loop.close()
            self._loop = None

    def __enter__(self) -> DistributedModelForCausalLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # --- inference sessions ---

    @contextlib.contextmanager
    def inference_session(self, max_length: int) -> Iterator[ClientSession]:
        """Keep a KV cache on the peers for up to `max_length` tokens per sequence.

        Inside it, forward() and generate() send only new tokens; several generate() calls continue
        one conversation when each passes the full sequence so far (or only the new tokens).
        """
        if self._session is not None:
            raise RuntimeError("an inference session is already open on this model; close it first")
        session = ClientSession(self, max_length)
        self._session = session
        try:
            yield session
        finally:
            self._session = None
            session.close()

    def generate(self, inputs: torch.Tensor | None = None, *args, **kwargs):
        """transformers' generate(), on the swarm. When a check caught a peer computing wrong results
        (client/inference_checks.py), generation starts again from the prompt, on the peers' caches as far as they
        were verified: the output is as if the liar had not been there (a streamer hears the new tokens again)."""
        prompt = inputs if inputs is not None else kwargs.get("input_ids", kwargs.get("inputs_embeds"))
        if speculative.requested(kwargs) and (args or prompt is None or prompt.dtype != torch.long):
            raise BadRequestError("speculative decoding takes input_ids (token ids) and keyword arguments only")
        if self._session is not None:
            return self._generate_checked(prompt, inputs, args, kwargs)
        prompt_length = prompt.shape[1] if prompt is not None else 1
        config = kwargs.get("generation_config") or self.generation_config
        max_new = kwargs.get("max_new_tokens", config.max_new_tokens)
        max_length = prompt_length + max_new if max_new is not None else kwargs.get("max_length", config.max_length)
        with self.inference_session(max_length=max_length):
            return self._generate_checked(prompt, inputs, args, kwargs)

    def _generate_checked(self, prompt: torch.Tensor | None, inputs, args, kwargs):
        session = self._session
        before = session.position  # tokens of earlier calls in the session
        # the prompt covers them (the whole conversation was passed), or follows them (only the new tokens were)
        covers = prompt is not None and prompt.shape[1] > before
        restart_at = prompt.shape[1] - 1 if covers else before  # its first forward must send a token at least
        for rewinds in itertools.count():
            try:
                if speculative.requested(kwargs):
                    output = speculative.generate(self, prompt, kwargs)
                else:
                    output = super().generate(inputs, *args, **kwargs)
                if session.remote is not None:
                    self._run(session.remote.settle())
                return output
            except OutputRewoundError as exc:
                if (exc.position < before and not covers) or rewinds >= self.sequence.config.max_retries:
                    raise  # into tokens this call cannot send again, or liar after liar: the caller decides
                keep = min(exc.position, restart_at)
                logger.warning("%s; generating again from the prompt on %d verified tokens", exc, keep)
                session.remote.truncate(keep)
                session.token_ids = session.token_ids[:, :keep] if session.token_ids is not None else None

    # --- forward ---

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        logits_to_keep: int = 0,
        output_router_logits: bool | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """As transformers' forward; with `output_router_logits` (by default the config's) on a mixture-of-experts
        model, the load-balancing loss too (`aux_loss`, and added to `loss` with labels), not the logits
        themselves: the peers report only their sums (swarm/models/routers.py)."""
        if (input_ids is None) == (inputs_embeds is None):
            raise BadRequestError("pass exactly one of input_ids or inputs_embeds")
        aux_loss = None
        if self._session is not None:
            hidden = self._session_step(input_ids, inputs_embeds, attention_mask, position_ids)
        else:
            hidden = (
                self.embed(input_ids) if inputs_embeds is None else ends.scale_embeddings(self.config, inputs_embeds)
            )
            if position_ids is None:
                position_ids = torch.arange(hidden.shape[1]).unsqueeze(0)
            if attention_mask is not None and bool(attention_mask.all()):
                attention_mask = None
            if output_router_logits is None:
                output_router_logits = getattr(self.config, "output_router_logits", False)
            moe = self.moe if output_router_logits else None
            if moe is not None:  # a mixture-of-experts model's load-balancing loss, as transformers computes it
                hidden, probs, counts, rows = RemoteBlocks.apply(
                    hidden, attention_mask, position_ids, self.sequence, self._run, moe
                )
                aux_loss = balance_loss(probs, counts, rows, moe.experts).to(hidden.dtype)
            else:
                hidden = RemoteBlocks.apply(hidden, attention_mask, position_ids, self.sequence, self._run)
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        logits = self.head(hidden)
        loss = None
        if labels is not None:
            loss = ForCausalLMLoss(logits=logits, labels=labels, vocab_size=self.config.vocab_size)
        if aux_loss is None:
            return CausalLMOutputWithPast(loss=loss, logits=logits)
        if loss is not None:
            loss = loss + self.config.router_aux_loss_coef * aux_loss
        return MoeCausalLMOutputWithPast(loss=loss, aux_loss=aux_loss, logits=logits)

    def _session_step(self, input_ids, inputs_embeds, attention_mask, position_ids) -> torch.Tensor:
        session = self._session
        done = session.position
        length = (input_ids if input_ids is not None else inputs_embeds).shape[1]
        # generate() may pass the whole sequence so far: send only what the peers have not seen
        covers_history = False
        if done and length > done:
            if input_ids is not None:
                covers_history = session.token_ids is not None and torch.equal(input_ids[:, :done], session.token_ids)
            else:
                covers_history = attention_mask is not None and attention_mask.shape[1] == length
            if covers_history:
                input_ids = input_ids[:, done:] if input_ids is not None else None
                inputs_embeds = inputs_embeds[:, done:] if inputs_embeds is not None else None
        hidden = self.embed(input_ids) if inputs_embeds is None else ends.scale_embeddings(self.config, inputs_embeds)
        new = hidden.shape[1]
        if position_ids is not None and (done == 0 or covers_history) and position_ids.shape[1] >= new:
            position_ids = position_ids[:, -new:]
        else:
            # positions given with only the new tokens count from the start of the caller's input (generate()
            # numbers a continuation from 0); the peers' caches fix where these tokens really are
            position_ids = self._next_positions(attention_mask, done, new)
        if session.remote is None:
            session.remote = InferenceSession(self.sequence, session.max_length, hidden.shape[0])
        try:
            output = self._run(session.remote.step(hidden.detach(), attention_mask, position_ids))
        except OutputRewoundError as exc:  # the peers hold the first exc.position tokens now
            session.token_ids = session.token_ids[:, : exc.position] if session.token_ids is not None else None
            raise
        if input_ids is not None:
            previous = session.token_ids[:, :done] if session.token_ids is not None else input_ids[:, :0]
            session.token_ids = torch.cat([previous, input_ids], dim=1)
        return output

    def _next_positions(self, attention_mask: torch.Tensor | None, done: int, new: int) -> torch.Tensor:
        """Positions of `new` tokens after the `done` the session holds: after left padding, counted per row."""
        remote = self._session.remote
        if attention_mask is None or attention_mask.shape[1] != done + new:
            past = remote.mask if remote is not None else None
            attention_mask = None if past is None else torch.cat([past, past.new_ones(past.shape[0], new)], dim=1)
        if attention_mask is None:
            return torch.arange(done, done + new).unsqueeze(0)
        return (attention_mask.long().cumsum(-1)[:, -new:] - 1).clamp(min=0)


class AutoDistributedModelForCausalLM:
    """Entry point: `AutoDistributedModelForCausalLM.from_pretrained(MODEL, initial_peers=[...])`."""

    @staticmethod
    def from_pretrained(model: str, **kwargs) -> DistributedModelForCausalLM:
        return DistributedModelForCausalLM.from_pretrained(model, **kwargs)


def _adapter_modules(options: ClientConfig, dtype: torch.dtype, local: set[str]) -> dict[str, torch.Tensor]:
    """The embeddings, norm or head that the adapter folder replaces, in `dtype`.

    Raises:
        ValueError: the folder is not an adapter, or replaces something the client does not hold.
    """
    replaced = whole_modules(options.adapter_path, options.adapter)
    unknown = sorted(set(replaced) - local)
    if unknown:
        raise ValueError(
            f"adapter {options.adapter}: {options.adapter_path} replaces {unknown[:3]} whole, which neither this "
            f"client ({sorted(local)}) nor the peers' LoRA layers hold"
        )
    return {name: tensor.to(dtype) for name, tensor in replaced.items()}
