"""Speculative decoding across the swarm: drafts proposed here, k+1 tokens verified in one trip through the chain.

A drafter proposes up to k tokens per row: n-grams taken from the context (`prompt_lookup_num_tokens`, as
transformers' prompt lookup), or a small local model with the same tokenizer (`assistant_model`). One inference
step sends the last token and the drafts through every peer. At each of the k+1 positions the swarm's logits pick
a token as plain decoding would (argmax, or a sample); the drafts are kept up to the first one that differs in any
row, plus the swarm's own token after them. The rest is cut from the session (InferenceSession.truncate): each peer
forgets it at the next step, which builds on the kept tokens (peer/inference.py treats it as a branch), and a
replay after a failover sends only kept tokens.

Exactness. Greedy: every kept token is the argmax given the kept tokens before it, so the output is plain greedy
decoding's. Sampling: a draft d is kept with probability p(d) and, where it is not, the token is drawn from p
without d (renormalised): the speculative-sampling rule for a draft distribution that puts all its mass on d, so
each token is distributed exactly as plain sampling's. Both drafters draft greedily for that reason.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from transformers import DynamicCache, LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper
from transformers.cache_utils import get_layer_types_and_kwargs

from client.session import InferenceSession
from protocol.errors import BadRequestError

logger = logging.getLogger(__name__)

SPECULATIVE_KWARGS = ("prompt_lookup_num_tokens", "assistant_model")


def requested(kwargs: dict) -> bool:
    """Whether generate()'s arguments ask for speculative decoding."""
    return any(kwargs.get(name) is not None for name in SPECULATIVE_KWARGS)


# generate() arguments that speculative decoding takes (the rest of transformers' assisted-generation arguments
# have no meaning here, and any other sampling control would change the distribution it must keep)
_TAKEN = {
    "input_ids",
    "inputs",
    "attention_mask",
    "max_new_tokens",
    "max_length",
    "do_sample",
    "temperature",
    "top_k",
    "top_p",
    "eos_token_id",
    "pad_token_id",
    "streamer",
    "generation_config",
    "prompt_lookup_num_tokens",
    "max_matching_ngram_size",
    "assistant_model",
    "num_assistant_tokens",
    "num_assistant_tokens_schedule",
    "generator",
    "use_cache",
}


@dataclass
class Stats:
    """What the latest speculative generate() did: `rounds` trips through the chain, `drafted` tokens proposed,
    `accepted` of them kept, `tokens` generated (per row)."""

    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    tokens: int = 0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_round(self) -> float:
        return self.tokens / self.rounds if self.rounds else 0.0


class NgramDrafter:
    """The tokens that followed the earliest earlier occurrence of the row's last n tokens (n from
    `max_ngram` down to 2), up to `num_tokens`: transformers' prompt lookup, per row.

    Unlike transformers', a single token's match drafts nothing (unless `max_ngram` is 1), and the length adapts:
    2 more (up to `num_tokens`) after a round that kept every draft, 1 fewer (at least 1) after one that kept none.
    Each draft is computed by every peer of the chain, so drafts that are seldom kept cost more than they save.
    Replayed on the built-in model's greedy output for the bench's prompts (bench/scenarios/speculative.py), at
    most 8 drafts: open chat computed 70 tokens for 64 in 54 round trips (transformers' rule: 204 in 52); the code
    edit 93 tokens for 46 in 16 round trips (transformers' rule: 118 in 14)."""

    def __init__(self, num_tokens: int, max_ngram: int = 2):
        if num_tokens < 1 or max_ngram < 1:
            raise BadRequestError(
                f"prompt_lookup_num_tokens and max_matching_ngram_size must be >= 1, got {num_tokens} and {max_ngram}"
            )
        self.num_tokens, self.max_ngram = num_tokens, max_ngram
        self.current = num_tokens

    def length(self) -> int:
        return self.current

    def propose(self, ids: torch.Tensor, mask: torch.Tensor, k: int) -> list[list[int]]:
        return [self._row(row[keep.bool()].tolist(), k) for row, keep in zip(ids, mask)]

    def _row(self, tokens: list[int], k: int) -> list[int]:
        for n in range(min(self.max_ngram, len(tokens) - 1), min(2, self.max_ngram) - 1, -1):
            tail = tokens[-n:]
            for start in range(len(tokens) - n):
                if tokens[start : start + n] == tail:
                    return tokens[start + n : start + n + k]
        return []

    def kept(self, ids: torch.Tensor, drafted: int, accepted: int) -> None:
        if drafted and accepted == drafted:
            self.current = min(self.num_tokens, self.current + 2)
        elif drafted and not accepted:
            self.current = max(1, self.current - 1)


class AssistantDrafter:
    """A local causal LM drafts greedily, with a KV cache of its own cut back to what the swarm kept. The draft
    length adapts as transformers' "heuristic" schedule does: 2 more after a round that kept every draft, 1 fewer
    (at least 1) after one that did not."""

    def __init__(self, model, num_tokens: int, adapt: bool):
        if num_tokens < 1:
            raise BadRequestError(f"num_assistant_tokens must be >= 1, got {num_tokens}")
        self.model, self.num_tokens, self.adapt = model, num_tokens, adapt
        self.cache = DynamicCache(config=model.config)
        self.held = 0  # tokens of the sequence in self.cache

    def length(self) -> int:
        return self.num_tokens

    @torch.inference_mode()
    def propose(self, ids: torch.Tensor, mask: torch.Tensor, k: int) -> list[list[int]]:
        device = self.model.device
        mask = mask.to(device)
        positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
        new = ids[:, self.held :].to(device)
        drafts = []
        for _ in range(k):
            logits = self.model(
                input_ids=new,
                attention_mask=mask,
                position_ids=positions[:, -new.shape[1] :],
                cache=self.cache,
                use_cache=True,
            ).logits
            new = logits[:, -1:].argmax(-1)
            drafts.append(new)
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
            positions = torch.cat([positions, positions[:, -1:] + 1], dim=1)
        self.held = ids.shape[1] + k - 1  # the last draft was never fed to the model
        return torch.cat(drafts, dim=1).tolist() if drafts else [[] for _ in range(ids.shape[0])]

    def kept(self, ids: torch.Tensor, drafted: int, accepted: int) -> None:
        """The swarm kept `accepted` of `drafted` drafts: `ids` is the sequence now, ending with its own token."""
        keep = min(self.held, ids.shape[1] - 1)
        extra = self.cache.get_seq_length() - keep
        if extra > 0:
            self.cache.crop(-extra)  # transformers' crop takes the number of tokens to remove, as a negative int
        self.held = keep
        if self.adapt:
            self.num_tokens = self.num_tokens + 2 if accepted == drafted else max(1, self.num_tokens - 1)


def drafter_for(kwargs: dict, config) -> NgramDrafter | AssistantDrafter:
    """The drafter that generate()'s arguments (and generation config `config`) ask for."""
    assistant = kwargs.get("assistant_model")
    if assistant is not None:
        if kwargs.get("prompt_lookup_num_tokens") is not None:
            raise BadRequestError("pass either assistant_model or prompt_lookup_num_tokens, not both")
        if getattr(assistant.config, "vocab_size", None) != config.vocab_size:
            raise BadRequestError(
                f"the assistant model's vocabulary ({assistant.config.vocab_size} tokens) is not the swarm model's "
                f"({config.vocab_size}): speculative decoding needs a model with the same tokenizer"
            )
        schedule = kwargs.get("num_assistant_tokens_schedule") or "heuristic"
        # transformers starts at 20; a draft costs a local forward and the heuristic grows it where drafts are kept
        num = kwargs.get("num_assistant_tokens") or 5
        return AssistantDrafter(assistant, num, adapt=schedule != "constant")
    return NgramDrafter(kwargs["prompt_lookup_num_tokens"], kwargs.get("max_matching_ngram_size") or 2)


def check_model(config, max_length: int) -> None:
    """Refusing drafts makes each peer cut its cache back, which a sliding-window layer can do only while it still
    holds every token: within its window."""
    types, _ = get_layer_types_and_kwargs(config)
    window = getattr(config, "sliding_window", None)
    if "sliding_attention" in types and window is not None and max_length >= window:
        raise BadRequestError(
            f"this model's sliding-window layers keep only the last {window} tokens, and speculative decoding goes "
            f"back over refused drafts: keep the prompt plus max_new_tokens under {window} ({max_length} asked), "
            f"or generate without prompt_lookup_num_tokens/assistant_model"
        )


def _warpers(do_sample: bool, temperature, top_k, top_p) -> LogitsProcessorList:
    warpers = LogitsProcessorList()
    if not do_sample:
        return warpers
    if temperature is not None and temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(temperature))
    if top_k is not None and top_k != 0:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p is not None and top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))
    return warpers


# generation-config settings that would change which tokens plain generate() picks, with their neutral values
_NEUTRAL = {
    "repetition_penalty": (None, 1.0),
    "no_repeat_ngram_size": (None, 0),
    "bad_words_ids": (None,),
    "min_length": (None, 0),
    "min_new_tokens": (None, 0),
    "suppress_tokens": (None,),
    "begin_suppress_tokens": (None,),
    "min_p": (None,),
    "typical_p": (None, 1.0),
    "epsilon_cutoff": (None, 0.0),
    "eta_cutoff": (None, 0.0),
    "num_beams": (None, 1),
    "num_return_sequences": (None, 1),
}


def check_arguments(kwargs: dict, config) -> None:
    unknown = sorted(name for name, value in kwargs.items() if name not in _TAKEN and value is not None)
    if unknown:
        raise BadRequestError(
            f"speculative decoding (prompt_lookup_num_tokens or assistant_model) does not take {', '.join(unknown)}; "
            f"it takes max_new_tokens, do_sample, temperature, top_k, top_p, eos_token_id, pad_token_id and streamer"
        )
    set_in_config = sorted(name for name, neutral in _NEUTRAL.items() if getattr(config, name, None) not in neutral)
    if set_in_config:
        raise BadRequestError(
            f"the generation config sets {', '.join(set_in_config)}, which speculative decoding does not apply; "
            f"pass a generation_config without them, or generate without prompt_lookup_num_tokens/assistant_model"
        )


class Verifier:
    """Picks the swarm's tokens at the k+1 positions of a round and how many drafts every row keeps."""

    def __init__(self, do_sample: bool, warpers: LogitsProcessorList, generator: torch.Generator | None):
        self.do_sample, self.warpers, self.generator = do_sample, warpers, generator

    def round(self, ids: torch.Tensor, drafts: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens [batch, k+1], drafts kept per row [batch]): tokens[:, i] is the swarm's token at position i
        given the drafts before it; where a row keeps m drafts, tokens[:, :m] are those drafts."""
        batch, k = drafts.shape
        logits = logits.float()
        if not self.do_sample:
            tokens = logits.argmax(-1)
            kept = (tokens[:, :k] == drafts).long().cumprod(dim=1).sum(dim=1)
            return tokens, kept
        tokens = torch.empty(batch, k + 1, dtype=torch.long)
        kept = torch.full((batch,), k, dtype=torch.long)
        sequence = ids
        for i in range(k + 1):
            scores = self.warpers(sequence, logits[:, i])
            probs = scores.softmax(-1)
            if i < k:
                draft = drafts[:, i]
                p_draft = probs.gather(1, draft[:, None]).squeeze(1)
                keep = torch.rand(batch, generator=self.generator) < p_draft
                others = probs.scatter(1, draft[:, None], 0.0)
                resampled = torch.multinomial(_normalised(others, probs), 1, generator=self.generator).squeeze(1)
                tokens[:, i] = torch.where(keep, draft, resampled)
                newly_out = (~keep) & (kept == k)
                kept[newly_out] = i
            else:
                tokens[:, i] = torch.multinomial(probs, 1, generator=self.generator).squeeze(1)
            sequence = torch.cat([sequence, tokens[:, i : i + 1]], dim=1)
        return tokens, kept


def _normalised(others: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """Rows of `others` (probs without the draft) to sample from; a row whose draft held all the mass (it is then
    always kept) gets `probs` so that multinomial has something to draw."""
    empty = others.sum(-1, keepdim=True) <= 0
    return torch.where(empty, probs, others)


def generate(model, input_ids: torch.Tensor, kwargs: dict) -> torch.Tensor:
    """Speculative decoding inside `model`'s open inference session; returns [batch, prompt + new] like
    generate(). `kwargs` are generate()'s (see check_arguments)."""
    config = kwargs.get("generation_config") or model.generation_config
    check_arguments(kwargs, config)

    def setting(name, default=None):
        return kwargs[name] if kwargs.get(name) is not None else getattr(config, name, default)

    max_new = setting("max_new_tokens")
    if kwargs.get("max_new_tokens") is None and kwargs.get("max_length") is not None:
        max_new = kwargs["max_length"] - input_ids.shape[1]
    if max_new is None or max_new < 1:
        raise BadRequestError(f"speculative decoding needs max_new_tokens >= 1, got {max_new}")
    do_sample = bool(setting("do_sample", False))
    verifier = Verifier(
        do_sample,
        _warpers(do_sample, setting("temperature"), setting("top_k"), setting("top_p")),
        kwargs.get("generator"),
    )
    eos = setting("eos_token_id")
    eos = torch.tensor([eos] if isinstance(eos, int) else list(eos or []), dtype=torch.long)
    pad = setting("pad_token_id")
    pad = pad if pad is not None else (int(eos[0]) if len(eos) else 0)
    drafter = drafter_for(kwargs, model.config)
    streamer = kwargs.get("streamer")
    session = model._session
    check_model(model.config, session.max_length)
    mask = kwargs.get("attention_mask")
    mask = torch.ones_like(input_ids) if mask is None else mask.to(torch.long)
    ids, batch, stats = input_ids, input_ids.shape[0], Stats()
    model.speculative_stats = stats
    offset, sent = _start(session, ids)
    known = session.token_ids  # what the session held before this call's sequence (None: not known)
    head = ids[:, :0] if not offset else known[:, :offset] if known is not None and known.shape[1] >= offset else None
    unfinished = torch.ones(batch, dtype=torch.bool)
    if streamer is not None:
        streamer.put(ids.cpu())
    while stats.tokens < max_new and bool(unfinished.any()):
        room = session.max_length - offset - ids.shape[1]  # the session holds the sequence and k drafts at most
        k = max(0, min(drafter.length(), max_new - stats.tokens - 1, room))
        drafts = _rectangular(drafter.propose(ids, mask, k) if k else [[]] * batch, k, pad)
        drafts[~unfinished] = pad  # a finished row gets padding: what its cache holds then matches the output
        k = drafts.shape[1]
        candidate = torch.cat([ids, drafts], dim=1)
        # the mask is the session's whole sequence only where this call's sequence is (else the session's own)
        candidate_mask = torch.cat([mask, mask.new_ones(batch, k)], dim=1) if offset == 0 else None
        with torch.inference_mode():
            logits = model(input_ids=candidate[:, sent:], attention_mask=candidate_mask).logits[:, -(k + 1) :]
        tokens, kept = verifier.round(ids, drafts, logits)
        n = int(kept[unfinished].min()) if k else 0
        n = min(n, max_new - stats.tokens - 1)
        new = tokens[:, : n + 1].clone()
        for i in range(new.shape[1]):  # as transformers: after its EOS a row gets padding
            new[:, i] = torch.where(unfinished, new[:, i], torch.full_like(new[:, i], pad))
            unfinished &= ~torch.isin(new[:, i], eos)
            if not bool(unfinished.any()):
                new = new[:, : i + 1]
                break
        # the peers keep the sequence and the kept drafts; the swarm's own last token is sent next round
        sent = ids.shape[1] + new.shape[1] - 1
        session.remote.truncate(offset + sent)
        ids = torch.cat([ids, new], dim=1)
        # a row finished in this round holds drafts where its output has padding: the output is what was sent
        session.token_ids = torch.cat([head, ids[:, :sent]], dim=1) if head is not None else None
        mask = torch.cat([mask, mask.new_ones(batch, new.shape[1])], dim=1)
        drafter.kept(ids, k, n)
        stats.rounds += 1
        stats.drafted += k
        stats.accepted += min(n, new.shape[1] - 1) if k else 0
        stats.tokens += new.shape[1]
        if streamer is not None:
            for i in range(new.shape[1]):
                streamer.put(new[:, i].cpu())
    if streamer is not None:
        streamer.end()
    logger.debug(
        "speculative: %d rounds, %d of %d drafts kept, %.2f tokens a round",
        stats.rounds,
        stats.accepted,
        stats.drafted,
        stats.tokens_per_round,
    )
    return ids


def _start(session, ids: torch.Tensor) -> tuple[int, int]:
    """(where `ids` starts in the session, how many of them it holds): `ids` is the whole conversation so far or
    follows it (generate() in an open session takes either). At least the last token is sent again: its logits
    give the first new token."""
    held, known = session.position, session.token_ids
    covers = held and known is not None and ids.shape[1] >= held and torch.equal(ids[:, :held], known[:, :held])
    offset, sent = (0, held) if covers or not held else (held, 0)
    sent = min(sent, ids.shape[1] - 1)
    if session.remote is not None and offset + sent < held:
        session.remote.truncate(offset + sent)
    if known is not None:
        session.token_ids = known[:, : offset + sent]
    return offset, sent


def _rectangular(rows: list[list[int]], k: int, pad: int) -> torch.Tensor:
    """Drafts of every row as one [batch, k'] tensor: k' the longest row's (at most k); shorter rows filled with
    `pad` (a filler the swarm is unlikely to keep, and harmless if it does: a kept draft is the swarm's own token)."""
    width = min(k, max((len(r) for r in rows), default=0))
    return torch.tensor([r[:width] + [pad] * (width - len(r[:width])) for r in rows], dtype=torch.long).reshape(
        len(rows), width
    )


class Totals:
    """Counts summed over the generations of one server (the API's /metrics), safe across worker threads."""

    def __init__(self):
        self._lock = threading.Lock()
        self.rounds = self.drafted = self.accepted = self.tokens = 0

    def add(self, rounds: int, drafted: int, accepted: int, tokens: int) -> None:
        with self._lock:
            self.rounds += rounds
            self.drafted += drafted
            self.accepted += accepted
            self.tokens += tokens


class SpeculativeDecoding(Iterator[int]):
    """The tokens of one generation of one row, several per trip through the swarm: what `swarmlm api
    --speculative` runs per request, as client/decoding.py's Decoding runs plain decoding (the same iterator, the
    same `settle()`); `verifier` picks the tokens as plain decoding would, `totals` counts what it did."""

    def __init__(self, model, prompt_ids: list[int], max_new_tokens: int, drafter, verifier: Verifier, totals: Totals):
        self.model, self.drafter, self.verifier, self.totals = model, drafter, verifier, totals
        # drafts never reach past the last token to generate: the session needs no room beyond it
        check_model(model.config, len(prompt_ids) + max_new_tokens)
        self.session = InferenceSession(model.sequence, len(prompt_ids) + max_new_tokens, batch_size=1)
        self._tokens = self._decode(torch.tensor([prompt_ids]), max_new_tokens)

    def __next__(self) -> int:
        return next(self._tokens)

    def settle(self) -> None:
        if not self.session.closed:
            self.model._run(self.session.settle())

    def close(self) -> None:
        """End the generation: its steps and the session (with a check that still runs)."""
        self._tokens.close()
        if not self.session.closed:
            self.model._run(self.session.close())

    def _logits(self, ids: torch.Tensor, sent: int, k: int) -> torch.Tensor:
        model = self.model
        with torch.inference_mode():
            hidden = model.embed(ids[:, sent:])
            positions = torch.arange(sent, ids.shape[1]).unsqueeze(0)
            output = model._run(self.session.step(hidden, None, positions))
            return model.head(output[:, -(k + 1) :]).float()

    def _decode(self, ids: torch.Tensor, max_new_tokens: int) -> Iterator[int]:
        sent, produced = 0, 0
        try:
            while produced < max_new_tokens:
                k = max(0, min(self.drafter.length(), max_new_tokens - produced - 1))
                drafts = _rectangular(self.drafter.propose(ids, torch.ones_like(ids), k) if k else [[]], k, 0)
                k = drafts.shape[1]
                logits = self._logits(torch.cat([ids, drafts], dim=1), sent, k)
                tokens, kept = self.verifier.round(ids, drafts, logits)
                n = min(int(kept[0]), max_new_tokens - produced - 1)
                new = tokens[:, : n + 1]
                sent = ids.shape[1] + n
                self.session.truncate(sent)
                ids = torch.cat([ids, new], dim=1)
                self.drafter.kept(ids, k, n)
                produced += new.shape[1]
                self.totals.add(1, k, n if k else 0, new.shape[1])
                yield from new[0].tolist()
        except BaseException:  # closed early, or failed; run out, it stays open for settle() (close() ends it)
            self.model._run(self.session.close())
            raise
