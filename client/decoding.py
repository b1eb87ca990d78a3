"""Token by token through the swarm, one generation per thread: what `swarmlm api` runs for each request.

`decode_tokens` opens an inference session (its own KV cache on every peer of the route, with failover), sends
the prompt, then each picked token, and yields the tokens; its `settle()` waits for the check of the route that
still runs, and raises OutputRewoundError if it caught a liar. The LM head goes through a `HeadBatcher` shared by the
generations of one model, so that concurrent generations compute it together (client/heads.py). Unlike
`generate()`, nothing here keeps logits or attention masks: one row, no padding.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from client.heads import HeadBatcher
from client.session import InferenceSession


def lm_head_batcher(model, max_wait_s: float = 0.0) -> HeadBatcher:
    """A HeadBatcher of `model`'s final norm and LM head (a DistributedModelForCausalLM); see HeadBatcher for
    `max_wait_s`, which keeps concurrent generations in lockstep."""
    return HeadBatcher(model.head, max_wait_s)


def decode_tokens(
    model,
    heads: HeadBatcher,
    prompt_ids: list[int],
    max_new_tokens: int,
    pick: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> Decoding:
    """Up to `max_new_tokens` tokens after `prompt_ids`; `pick(ids [1, length], logits [1, vocab])` gives the
    next token [1]. Closing the iterator closes the session on every peer. Call from a thread other than the
    client's event loop (each step blocks until the peers have answered)."""
    return Decoding(model, heads, prompt_ids, max_new_tokens, pick)


class Decoding(Iterator[int]):
    """The tokens of one generation (decode_tokens), and `settle()` once the caller has all it wants of them."""

    def __init__(self, model, heads: HeadBatcher, prompt_ids: list[int], max_new_tokens: int, pick) -> None:
        self.model = model
        self.session: InferenceSession | None = None  # opened by the first step
        self._tokens = self._decode(heads, prompt_ids, max_new_tokens, pick)

    def __next__(self) -> int:
        return next(self._tokens)

    def settle(self) -> None:
        """Wait for the check of the route still running (client/inference_checks.py); OutputRewoundError if it
        caught a peer computing wrong results: the tokens so far may be wrong, and only a new generation is sure."""
        if self.session is not None and not self.session.closed:
            self.model._run(self.session.settle())

    def close(self) -> None:
        """End the generation: its steps and the session (with a check that still runs)."""
        self._tokens.close()
        if self.session is not None and not self.session.closed:
            self.model._run(self.session.close())

    def _decode(self, heads: HeadBatcher, prompt_ids: list[int], max_new_tokens: int, pick) -> Iterator[int]:
        model = self.model
        ids = torch.tensor([prompt_ids])
        session = self.session = InferenceSession(model.sequence, len(prompt_ids) + max_new_tokens, batch_size=1)
        decoding = contextlib.ExitStack()
        try:
            new, done = ids, 0
            for _ in range(max_new_tokens):
                with torch.inference_mode():
                    hidden = model.embed(new)
                positions = torch.arange(done, done + new.shape[1]).unsqueeze(0)
                output = model._run(session.step(hidden, None, positions))
                done += new.shape[1]
                if done == len(prompt_ids):  # prefilled: from now on a round of heads may wait for this generation
                    decoding.enter_context(heads.member())
                logits = heads.logits(output[:, -1]).float()
                with torch.inference_mode():
                    token = pick(ids, logits)
                ids = torch.cat([ids, token.view(1, 1)], dim=1)
                yield int(token)
                new = token.view(1, 1)
        except BaseException:  # closed early, or failed; run out, it stays open for settle() (close() ends it)
            model._run(session.close())
            raise
        finally:
            decoding.close()
