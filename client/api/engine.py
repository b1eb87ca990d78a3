"""The swarm behind the API: one DistributedModelForCausalLM and its tokenizer, an inference session per request.

Each generation opens its own `InferenceSession` (its own KV cache on every peer of its route, with failover),
so concurrent requests never share a cache; its steps run on the client's event loop, called from the worker
thread that runs the generation (client/decoding.py). The LM heads of generations whose steps come back together
are computed as one batch (client/heads.py). Tokens are picked here as Hugging Face's `generate()` picks them
(argmax, or temperature then top-p then `torch.multinomial`), with a generator of the request's own seeded from
`seed`: the same seed gives the same tokens as `torch.manual_seed(seed)` before a local `generate()` with those
settings.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper

from client import speculative
from client.api.errors import ApiError, bad_request
from client.api.schemas import Sampling
from client.decoding import decode_tokens, lm_head_batcher
from client.model import DistributedModelForCausalLM


class TokenPicker:
    """Picks each next token from the logits of the last position, like `generate()` with the same settings."""

    def __init__(self, sampling: Sampling):
        self.greedy = sampling.greedy
        self.processors = LogitsProcessorList()
        if not self.greedy:
            if sampling.temperature != 1.0:
                self.processors.append(TemperatureLogitsWarper(sampling.temperature))
            if sampling.top_p < 1.0:
                self.processors.append(TopPLogitsWarper(sampling.top_p))
        seed = sampling.seed if sampling.seed is not None else secrets.randbits(63)
        self.generator = torch.Generator().manual_seed(seed)

    def pick(self, ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """The next token [batch] given the sequence so far `ids` [batch, length] and `logits` [batch, vocab]."""
        if self.greedy:
            return logits.argmax(-1)
        scores = self.processors(ids, logits)
        probs = torch.nn.functional.softmax(scores, dim=-1)
        return torch.multinomial(probs, num_samples=1, generator=self.generator).squeeze(1)


class SwarmBackend:
    """The `generation.Backend` of a model served by the swarm. With `drafter` (a function returning a fresh
    client/speculative.py drafter), every generation decodes speculatively; `speculative` sums what they did."""

    def __init__(self, model: DistributedModelForCausalLM, tokenizer, model_id: str, drafter=None):
        self.model, self.tokenizer, self.model_id = model, tokenizer, model_id
        self.drafter, self.speculative = drafter, speculative.Totals()
        self.context_length = int(model.config.max_position_embeddings)
        eos = model.generation_config.eos_token_id
        eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        if tokenizer.eos_token_id is not None:
            eos.append(tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self.heads = lm_head_batcher(model)  # shared by the generations: see client/decoding.py

    # --- text ---

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer(prompt)["input_ids"]
        else:
            ids = list(prompt)
            vocab = self.model.config.vocab_size
            bad = next((i for i in ids if not 0 <= i < vocab), None)
            if bad is not None:
                raise bad_request(f"prompt: token id {bad} is outside the vocabulary [0, {vocab})", "prompt")
        if not ids:
            raise bad_request("prompt: the prompt is empty (and the tokenizer adds no BOS token)", "prompt")
        return ids

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise bad_request(
                f"model {self.model_id!r} has no chat template; use /v1/completions with a prompt",
                "messages",
                code="no_chat_template",
            )
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # a template may refuse an order of roles (jinja's raise_exception)
            raise ApiError(
                400, f"messages: the model's chat template refused them: {exc}", param="messages", code="invalid_value"
            ) from None
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if not ids:
            raise bad_request("messages: the chat template gave an empty prompt", "messages")
        return ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    # --- generation ---

    def tokens(self, prompt_ids: list[int], max_new_tokens: int, sampling: Sampling) -> Iterator[int]:
        picker = TokenPicker(sampling)
        if self.drafter is None:
            return decode_tokens(self.model, self.heads, prompt_ids, max_new_tokens, picker.pick)
        # drafts kept by the speculative-sampling rule: a seed gives the same output each time, and the output
        # is distributed as plain sampling's, but it is not the same tokens as without --speculative
        verifier = speculative.Verifier(not picker.greedy, picker.processors, picker.generator)
        return speculative.SpeculativeDecoding(
            self.model, prompt_ids, max_new_tokens, self.drafter(), verifier, self.speculative
        )

    # --- the swarm ---

    def uncovered_blocks(self) -> list[int]:
        return self.model._run(self._uncovered())

    async def _uncovered(self) -> list[int]:
        sequence = self.model.sequence
        snapshot = await sequence.snapshot()
        banned = sequence.bans.banned(snapshot.expirations)
        return [block for block in range(sequence.num_blocks) if not set(snapshot.servers_of_block(block)) - banned]

    def failovers(self) -> int:
        sequence = self.model.sequence
        return sequence.failovers if sequence is not None else 0
