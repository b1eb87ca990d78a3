"""Admission control: hard caps on one request, and a bounded queue that refuses at once when full."""

from __future__ import annotations

import pytest

from peer.admission import Admission, WorkLimits
from protocol.errors import MessageTooLargeError, OverloadedError, SequenceTooLongError


def test_hard_caps_name_the_limit_and_what_to_do():
    admission = Admission(WorkLimits(max_request_tokens=100, max_attention_cost=2000), max_positions=64)
    admission.check(batch=2, new_tokens=20)  # 40 tokens, 2 x 20 x 20 = 800 pairs
    with pytest.raises(MessageTooLargeError, match=r"2 x 60 = 120 tokens .* 100 \(--max-request-tokens\)"):
        admission.check(batch=2, new_tokens=60)
    with pytest.raises(MessageTooLargeError, match="--max-attention-cost"):
        admission.check(batch=1, new_tokens=10, prefix_length=50)  # 10 x 60 = 600: fine
        admission.check(batch=4, new_tokens=20, prefix_length=10)  # 80 x 30 = 2400: over
    with pytest.raises(SequenceTooLongError, match="model's 64 positions"):
        admission.check(batch=1, new_tokens=2, prefix_length=63)


def test_a_full_queue_refuses_at_once_but_an_empty_one_takes_any_request():
    admission = Admission(WorkLimits(max_queued_tokens=100, max_queued_bytes=1000), max_positions=64)
    with admission.admit(500, 10**6):  # alone: admitted, whatever its size
        with pytest.raises(OverloadedError, match="1 requests of 500 tokens"):
            with admission.admit(1, 1):
                pass
    with admission.admit(60, 100), admission.admit(40, 100):
        assert (admission.queued_requests, admission.queued_tokens) == (2, 100)
        with pytest.raises(OverloadedError), admission.admit(1, 1):
            pass
    with admission.admit(60, 100), pytest.raises(OverloadedError, match="MiB"), admission.admit(1, 901):
        pass
    assert (admission.queued_requests, admission.queued_tokens, admission.queued_bytes) == (0, 0, 0)


@pytest.mark.parametrize("name", ["max_request_tokens", "max_attention_cost", "max_queued_tokens", "max_queued_bytes"])
def test_limits_must_be_positive(name):
    with pytest.raises(ValueError, match=name):
        WorkLimits(**{name: 0})
