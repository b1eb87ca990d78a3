"""The `swarmlm` entry point: flags renamed to carry their unit still parse under their old spelling."""

from __future__ import annotations

import contextlib
import io

import pytest

from swarm.cli import RENAMED_FLAGS, accept_renamed_flags, main


def test_an_old_flag_sets_the_renamed_one_and_is_hidden_from_help():
    import peer.cli

    parser = accept_renamed_flags(peer.cli.build_parser("swarmlm peer"))
    args = parser.parse_args(["model", "--session-timeout", "5", "--update-period-s", "7"])
    assert args.session_timeout_s == 5.0 and args.update_period_s == 7.0 and args.alloc_timeout_s == 10.0
    shown = parser.format_help()
    assert "--session-timeout-s" in shown and "--session-timeout " not in shown and "--session-timeout\n" not in shown


def test_every_renamed_flag_exists_in_some_command():
    import client.api.cli
    import client.training.cli
    import peer.cli

    flags = {
        option
        for module in (peer.cli, client.training.cli, client.api.cli)
        for action in module.build_parser("x")._actions
        for option in action.option_strings
    }
    assert set(RENAMED_FLAGS.values()) <= flags, set(RENAMED_FLAGS.values()) - flags


def test_an_unknown_command_is_refused_with_the_list():
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(["peers"]) == 2
    assert "unknown command 'peers'" in err.getvalue() and "bootstrap" in err.getvalue()


@pytest.mark.parametrize("flag", ["-h", "--help"])
def test_help_lists_the_commands(flag):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main([flag]) == 0
    assert "demo" in out.getvalue() and "monitor" in out.getvalue()
