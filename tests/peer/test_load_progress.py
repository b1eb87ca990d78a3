"""A peer loading its blocks shows bytes and blocks on a terminal, and writes nothing when stderr is not one."""

from __future__ import annotations

import fcntl
import os
import pty
import struct
import sys
import termios

import torch

from peer.blocks import load_span
from swarm.models.checkpoint import load_config
from tests.helpers.models import make_tiny_llama


def test_loading_blocks_is_silent_off_a_terminal(tmp_path, capsys):
    path = make_tiny_llama(tmp_path / "tiny", num_layers=4)
    capsys.readouterr()  # what saving the model wrote
    span = load_span(path, load_config(path), 1, 3, dtype=torch.float32, device=torch.device("cpu"))
    assert len(span.layers) == 2
    assert capsys.readouterr().err == ""


def test_loading_blocks_draws_a_bar_on_a_terminal(tmp_path, monkeypatch):
    path = make_tiny_llama(tmp_path / "tiny", num_layers=4)
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    try:
        with os.fdopen(follower, "w", closefd=False) as terminal:
            monkeypatch.setattr(sys, "stderr", terminal)
            load_span(path, load_config(path), 1, 3, dtype=torch.float32, device=torch.device("cpu"))
            terminal.flush()
        drawn = os.read(leader, 65536).decode()
    finally:
        os.close(leader)
        os.close(follower)
    # the bar of the bytes of blocks 1 and 2 (erased once done: leave=False)
    assert "loading blocks 1:3" in drawn and "B/s" in drawn, drawn
