"""Progress bars are drawn on a terminal only: a stream that is not a TTY gets nothing."""

from __future__ import annotations

import fcntl
import io
import os
import pty
import select
import struct
import termios

from swarm.progress import progress, progress_enabled


class _Closed(io.StringIO):
    def isatty(self):
        raise ValueError("I/O operation on closed file")


def test_a_plain_stream_gets_no_bar():
    stream = io.StringIO()
    assert not progress_enabled(stream) and not progress_enabled(_Closed()) and not progress_enabled(object())
    with progress(total=3, desc="loading blocks", unit="block", stream=stream) as bar:
        bar.update(3)
    assert stream.getvalue() == ""


def read_available(fd: int, quiet_s: float = 0.5, max_reads: int = 100) -> str:
    """What a pty's leader has to read, until it stays quiet `quiet_s` (one read may return only the first draw)."""
    chunks = []
    for _ in range(max_reads):
        ready, _, _ = select.select([fd], [], [], quiet_s)
        if not ready:
            break
        chunks.append(os.read(fd, 65536))
    return b"".join(chunks).decode()


def test_a_terminal_gets_a_bar():
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # 24 rows, 100 columns
    try:
        with os.fdopen(follower, "w", closefd=False) as terminal:
            assert progress_enabled(terminal)
            with progress(total=3, desc="loading blocks", unit="block", stream=terminal) as bar:
                bar.update(3)
            terminal.flush()
        drawn = read_available(leader)
    finally:
        os.close(leader)
        os.close(follower)
    assert "loading blocks" in drawn and "3/3" in drawn, drawn
