"""client/checks.py: the caller's bad input is refused before sending; a peer's wrong answer or refusal is its fault."""

from __future__ import annotations

import asyncio

import pytest
import torch

from client import checks
from client.config import ClientConfig
from client.sequence import RemoteSequence
from client.session import InferenceSession
from protocol import swarmlm_pb2 as pb
from protocol.codec import encode_tensor
from protocol.errors import (
    BadRequestError,
    CacheFullError,
    InternalError,
    MessageTooLargeError,
    NoPeersError,
    PeerFaultError,
    PeerUnavailableError,
    SequenceTooLongError,
    StaleEpochError,
    UnknownSessionError,
    WrongSpanError,
)
from protocol.packing import Packer, Received, unpack

HIDDEN = 8


def _hidden(*shape, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0)).to(dtype)


# --- the caller's input ---


@pytest.mark.parametrize(
    "hidden, mask, positions, prefix, error, words",
    [
        (_hidden(3, HIDDEN), None, None, 0, BadRequestError, "must be [batch, seq, hidden]"),
        (_hidden(1, 0, HIDDEN), None, None, 0, BadRequestError, "at least one sequence and one token"),
        (_hidden(1, 2, HIDDEN + 1), None, None, 0, BadRequestError, "hidden size 9, this model's is 8"),
        (torch.ones(1, 2, HIDDEN, dtype=torch.int64), None, None, 0, BadRequestError, "floating point"),
        (torch.full((1, 2, HIDDEN), float("nan")), None, None, 0, BadRequestError, "NaN or inf"),
        (torch.full((1, 2, HIDDEN), float("-inf"), dtype=torch.bfloat16), None, None, 0, BadRequestError, "NaN or inf"),
        (_hidden(1, 2, HIDDEN), torch.ones(1, 2, dtype=torch.int64), None, 3, BadRequestError, "shape [1, 5]"),
        (_hidden(1, 2, HIDDEN), torch.tensor([[1, 2]]), None, 0, BadRequestError, "0 or 1"),
        (_hidden(1, 2, HIDDEN), torch.ones(1, 2), None, 0, BadRequestError, "integer or bool"),
        (_hidden(1, 2, HIDDEN), None, torch.tensor([[0, 1, 2]]), 0, BadRequestError, "shape [1 or 1, 2]"),
        (_hidden(1, 2, HIDDEN), None, torch.tensor([[0.0, 1.0]]), 0, BadRequestError, "integers"),
        (_hidden(1, 2, HIDDEN), None, torch.tensor([[-1, 0]]), 0, BadRequestError, ">= 0"),
        (_hidden(1, 2, HIDDEN), None, torch.tensor([[15, 16]]), 0, BadRequestError, "[0, 16)"),
        (_hidden(1, 2, HIDDEN), None, None, 15, SequenceTooLongError, "17 tokens exceed the model's 16 positions"),
    ],
)
def test_inputs_a_peer_would_refuse_are_refused_here(hidden, mask, positions, prefix, error, words):
    with pytest.raises(error, match=words.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        checks.check_inputs(hidden, mask, positions, hidden_size=HIDDEN, max_positions=16, prefix_length=prefix)


def test_good_inputs_pass():
    checks.check_inputs(
        _hidden(2, 3, HIDDEN),
        torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]]),
        torch.tensor([[0, 0, 1], [1, 2, 3]]),
        hidden_size=HIDDEN,
        max_positions=16,
        prefix_length=1,
    )
    checks.check_inputs(
        _hidden(1, 3, HIDDEN, dtype=torch.bfloat16),
        torch.ones(1, 3, dtype=torch.bool),
        torch.arange(3)[None],
        hidden_size=None,
        max_positions=None,
    )
    checks.check_grad(_hidden(1, 3, HIDDEN), (1, 3, HIDDEN))


def test_bad_input_fails_before_any_network_call():
    """No DHT at all: had anything been sent (or the swarm looked up), the error would not be a BadRequestError."""
    sequence = RemoteSequence(
        None, "model", 2, ClientConfig(initial_peers=("/ip4/127.0.0.1/tcp/1",)), hidden_size=HIDDEN, max_positions=16
    )
    nan = torch.full((1, 2, HIDDEN), float("nan"))

    async def go():
        with pytest.raises(BadRequestError, match="NaN or inf"):
            await sequence.forward(nan, None, torch.arange(2)[None])
        with pytest.raises(SequenceTooLongError, match="17 tokens exceed the model's 16 positions"):
            await sequence.forward(_hidden(1, 17, HIDDEN), None, None)
        session = InferenceSession(sequence, max_length=8, batch_size=1)
        with pytest.raises(BadRequestError, match="NaN or inf"):
            await session.step(nan, None, torch.arange(2)[None])
        with pytest.raises(SequenceTooLongError, match="max_length 8"):
            await session.step(_hidden(1, 9, HIDDEN), None, torch.arange(9)[None])
        with pytest.raises(BadRequestError, match="attention_mask must have shape"):
            await session.step(_hidden(1, 2, HIDDEN), torch.ones(1, 3, dtype=torch.int64), torch.arange(2)[None])
        with pytest.raises(SequenceTooLongError, match="max_length 17 exceeds the model's 16 positions"):
            InferenceSession(sequence, max_length=17, batch_size=1)
        await sequence.close()

    asyncio.run(go())


def test_a_bad_gradient_is_the_callers():
    with pytest.raises(BadRequestError, match="shape"):
        checks.check_grad(_hidden(1, 2, HIDDEN), (1, 3, HIDDEN))
    with pytest.raises(BadRequestError, match="NaN or inf; check the loss"):
        checks.check_grad(torch.full((1, 3, HIDDEN), float("nan")), (1, 3, HIDDEN))


def test_the_size_of_a_packed_request_is_counted_without_serializing_it():
    packer = Packer()
    big = packer.pack(pb.ForwardRequest(hidden_states=packer.tensor(_hidden(1, 2048, HIDDEN))))
    small = pb.ForwardRequest(hidden_states=encode_tensor(_hidden(1, 2, HIDDEN)))
    for message in (big, small):
        assert checks.message_bytes(message) == len(message.SerializeToString())
    checks.check_size(big, len(big.SerializeToString()))
    with pytest.raises(MessageTooLargeError, match="max_message_bytes"):
        checks.check_size(big, len(big.SerializeToString()) - 1)


# --- whose fault a peer's error is ---


@pytest.mark.parametrize(
    "error",
    [
        BadRequestError("hidden_states contains NaN or inf"),
        MessageTooLargeError("over the limit"),
        SequenceTooLongError("exceed max_length"),
        StaleEpochError("at update 3"),
        NoPeersError("nobody"),
    ],
)
def test_a_peer_refusing_checked_input_is_at_fault(error):
    blamed = checks.blame(error, "peer-x at 127.0.0.1:1")
    assert type(blamed) is PeerFaultError and blamed.__cause__ is error
    assert "peer-x at 127.0.0.1:1" in str(blamed) and error.code in str(blamed) and str(error) in str(blamed)


@pytest.mark.parametrize(
    "error",
    [
        UnknownSessionError("lost"),
        WrongSpanError("moved"),
        CacheFullError("full"),
        PeerUnavailableError("gone"),
        InternalError("bug"),
        PeerFaultError("lied"),
        RuntimeError("a bug of ours"),
    ],
)
def test_other_failures_keep_their_type(error):
    assert checks.blame(error, "peer-x") is error


def test_stale_epoch_is_the_trainers_in_training_only():
    error = StaleEpochError("at update 3")
    assert checks.blame(error, "peer-x", training=True) is error
    assert type(checks.blame(error, "peer-x", training=False)) is PeerFaultError


# --- a peer's answers ---


def _received(message) -> Received:
    """`message` as the client receives it (through the payload when its tensors are large)."""
    return unpack(type(message.message if hasattr(message, "chunks") else message), message.SerializeToString())


def _forward_answer(tensor: torch.Tensor | None) -> Received:
    packer = Packer()
    fields = {} if tensor is None else {"hidden_states": packer.tensor(tensor)}
    return _received(packer.pack(pb.ForwardResponse(**fields)))


@pytest.mark.parametrize("tokens", [2, 2048], ids=["inline", "payload"])
def test_a_right_answer_is_used(tokens):
    sent = _hidden(1, tokens, HIDDEN)
    got = checks.unary_answer(_forward_answer(sent), "hidden_states", peer="p", shape=sent.shape, dtype=torch.float32)
    assert torch.equal(got, sent)


@pytest.mark.parametrize(
    "answer, words",
    [
        (None, "answered without hidden_states"),
        (_hidden(1, 3, HIDDEN), r"shape \[1, 3, 8\], expected \[1, 2, 8\]"),
        (_hidden(2, 2, HIDDEN), r"shape \[2, 2, 8\]"),
        (_hidden(1, 2, HIDDEN, dtype=torch.float16), "dtype torch.float16, expected torch.float32"),
        (_hidden(1, 2, HIDDEN, dtype=torch.float64), "dtype torch.float64"),
        (torch.full((1, 2, HIDDEN), float("nan")), "NaN or inf"),
        (torch.full((1, 2, HIDDEN), float("inf")), "NaN or inf"),
    ],
)
def test_a_wrong_answer_is_the_peers_fault(answer, words):
    with pytest.raises(PeerFaultError, match=words):
        checks.unary_answer(
            _forward_answer(answer), "hidden_states", peer="p", shape=(1, 2, HIDDEN), dtype=torch.float32
        )


def test_a_malformed_tensor_is_the_peers_fault():
    message = pb.ForwardResponse(hidden_states=pb.Tensor(shape=[1, 2, HIDDEN], dtype="float32", data=b"short"))
    with pytest.raises(PeerFaultError, match=r"malformed hidden_states.*needs 64 bytes"):
        checks.unary_answer(_received(message), "hidden_states", peer="p", shape=(1, 2, HIDDEN), dtype=torch.float32)


def _step_answer(step_id=7, position=5, hidden=None, kind="step") -> Received:
    if kind == "opened":
        return _received(pb.InferenceResponse(opened=pb.SessionOpened(session_id="s", max_length=8)))
    if kind is None:
        return _received(pb.InferenceResponse())
    hidden = _hidden(1, 2, HIDDEN) if hidden is None else hidden
    return _received(
        pb.InferenceResponse(
            step=pb.StepResult(hidden_states=encode_tensor(hidden), step_id=step_id, position=position)
        )
    )


@pytest.mark.parametrize(
    "answer, words",
    [
        (_step_answer(kind="opened"), "answered a step with opened, expected step"),
        (_step_answer(kind=None), "answered a step with an empty message"),
        (_step_answer(step_id=6), "answered step 6, expected step 7"),
        (_step_answer(position=6), "holds 6 tokens after this step, expected 5"),
        (_step_answer(position=0), "holds 0 tokens"),
        (_step_answer(hidden=_hidden(1, 1, HIDDEN)), "shape"),
        (_step_answer(hidden=torch.full((1, 2, HIDDEN), float("nan"))), "NaN or inf"),
    ],
)
def test_a_wrong_step_answer_is_the_peers_fault(answer, words):
    with pytest.raises(PeerFaultError, match=words):
        checks.step_answer(answer, peer="p", shape=(1, 2, HIDDEN), dtype=torch.float32, step_id=7, position=5)


def test_a_right_step_answer_is_used():
    got = checks.step_answer(_step_answer(), peer="p", shape=(1, 2, HIDDEN), dtype=torch.float32, step_id=7, position=5)
    assert torch.equal(got, _hidden(1, 2, HIDDEN))


def test_an_open_must_be_answered_by_opened_for_the_same_session():
    checks.opened_answer(_step_answer(kind="opened"), peer="p", session_id="s", max_length=8)
    with pytest.raises(PeerFaultError, match="answered an open with step"):
        checks.opened_answer(_step_answer(), peer="p", session_id="s", max_length=8)
    with pytest.raises(PeerFaultError, match="opened session 's' of max_length 8, asked for 't' of 8"):
        checks.opened_answer(_step_answer(kind="opened"), peer="p", session_id="t", max_length=8)
