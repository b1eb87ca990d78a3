"""The docs say what the code does: every command and flag shown in README.md and docs/*.md exists in its parser,
and every relative link and repository path resolves.

The rules, kept simple so that a writer can follow them:
- A command is `swarmlm NAME ...` (also `.venv/bin/swarmlm NAME ...`) or `python -m MODULE ...` for a module of this
  repository (`python -m bench` is `swarmlm bench`). In a code block every line is a command line: a trailing `\\`
  joins the next one, ` #` starts a comment, `&&`, `||`, `|` and `;` separate commands, and a line that starts with
  `#` (a comment, or a command's output) is skipped. In prose, every inline code span is one command line.
- Every flag of a command (`-x`, `--long`, `--long=VALUE`) must be an option of that command's parser: for
  `swarmlm NAME`, `build_parser(prog)` of the module swarm/cli.py's COMMANDS maps it to; for `python -m MODULE`,
  the option strings its source passes to `add_argument`. Old spellings of renamed flags do not count.
- An inline code span that starts with a flag (`--cache-tokens`, `--blocks 0:10`) belongs to the command named
  last before it in the same section (a heading starts a section): in a code block, in inline code, or in the
  heading. With none named yet in the section, it is an error: name the command first.
- A flag in plain text, outside code, is an error: flags go in code, where they are checked.
- A relative link (`[text](path#fragment)`, images too) must point at a file or folder of the repository, and a
  fragment at a heading of its page (GitHub's anchors).
- Inline code that is a path starting with a top-level folder of the repository (`peer/inference.py`,
  `tests/integration/`, `bench/figures/*.md`) must exist.
"""

from __future__ import annotations

import ast
import functools
import importlib
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = (REPO / "README.md", *sorted((REPO / "docs").glob("*.md")))
README_MAX_LINES = 250
TOP_FOLDERS = ("protocol", "swarm", "peer", "client", "bench", "tests", "docs", ".ci")

FENCE = re.compile(r"^\s*(`{3,}|~{3,})")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")
CODE_SPAN = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.DOTALL)
LINK = re.compile(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
SWARMLM = re.compile(r"(?<![\w.-])swarmlm\s+(\S+)(.*)")
PYTHON_M = re.compile(r"(?<![\w.-])(?:\S*/)?python3?\s+-m\s+([\w.]+)(.*)")
FLAG = re.compile(r"(?<![\w-])(--?[A-Za-z][\w-]*)")
PROSE_FLAG = re.compile(r"(?<![\w`-])(--[A-Za-z][\w-]*)")
SEPARATORS = re.compile(r"&&|\|\||[|;]")
REPO_PATH = re.compile(r"(?:\./)?(?:" + "|".join(re.escape(top) for top in TOP_FOLDERS) + r")/[\w./*-]*")


@dataclass(frozen=True)
class Problem:
    path: str
    line: int
    message: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.message}"


# --- what the parsers accept ---


@functools.cache
def swarmlm_options(name: str) -> frozenset[str] | None:
    """The option strings of `swarmlm NAME`, or None if there is no such command."""
    from swarm.cli import COMMANDS

    if name not in COMMANDS:
        return None
    parser = importlib.import_module(COMMANDS[name][0]).build_parser(f"swarmlm {name}")
    return frozenset(option for action in parser._actions for option in action.option_strings)


@functools.cache
def module_options(module: str) -> frozenset[str] | None:
    """The option strings that MODULE's source passes to `add_argument`, or None if it is not in this repository."""
    base = REPO / module.replace(".", "/")
    source = next((p for p in (base.with_suffix(".py"), base / "__main__.py") if p.is_file()), None)
    if source is None:
        return None
    options = set()
    for node in ast.walk(ast.parse(source.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument":
            names = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            options.update(name for name in names if name.startswith("-"))
            if any(k.arg == "action" and "BooleanOptional" in ast.unparse(k.value) for k in node.keywords):
                options.update(f"--no-{name[2:]}" for name in names if name.startswith("--"))
    return frozenset(options)


Options = Callable[[str], frozenset[str] | None]


def options_for(command: str) -> frozenset[str] | None:
    """The options of COMMAND ("swarmlm NAME" or "python -m MODULE"); None when it cannot be checked."""
    kind, _, name = command.rpartition(" ")
    if kind == "swarmlm":
        return swarmlm_options(name)
    return swarmlm_options("bench") if name == "bench" else module_options(name)


# --- reading a page ---


@dataclass(frozen=True)
class _Event:
    """Something the checker meets, in reading order."""

    line: int
    kind: Literal["heading", "command", "flags", "unclosed"]
    text: str


@dataclass
class _Page:
    """What a page shows, each item with the line it is on."""

    events: list[_Event] = field(default_factory=list)
    links: list[tuple[int, str]] = field(default_factory=list)
    paths: list[tuple[int, str]] = field(default_factory=list)  # repository paths in inline code
    loose_flags: list[tuple[int, str]] = field(default_factory=list)  # flags in plain text


def _commands(text: str) -> list[tuple[str, str]]:
    """(command, its arguments) for each command in one command line."""
    found = []
    for segment in SEPARATORS.split(text):
        if match := SWARMLM.search(segment):
            found.append((f"swarmlm {match.group(1)}", match.group(2)))
        elif match := PYTHON_M.search(segment):
            found.append((f"python -m {match.group(1)}", match.group(2)))
    return found


def _code_lines(lines: list[tuple[int, str]]) -> list[_Event]:
    """The command lines of one code block: continuations joined, comments and output dropped."""
    events, pending, start = [], "", 0
    for number, line in lines:
        if not pending:
            start = number
            if line.lstrip().startswith("#"):
                continue
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        events.append(_Event(start, "command", pending.split(" #")[0]))
        pending = ""
    if pending:
        events.append(_Event(start, "command", pending.split(" #")[0]))
    return events


def _read_prose(page: _Page, block: list[tuple[int, str]]) -> None:
    """Add what one paragraph (or heading) shows: inline code spans, then links and flags outside them."""
    if not block:
        return
    first, body = block[0][0], "\n".join(line for _, line in block)

    def line_of(offset: int) -> int:
        return first + body.count("\n", 0, offset)

    outside = body
    for span in CODE_SPAN.finditer(body):
        code, at = span.group(2).replace("\n", " ").strip(), line_of(span.start())
        outside = outside[: span.start()] + " " * len(span.group(0)) + outside[span.end() :]
        if code.startswith("--"):
            page.events.append(_Event(at, "flags", code))
        elif _commands(code):
            page.events.append(_Event(at, "command", code))
        elif REPO_PATH.fullmatch(code.split("::")[0]):
            page.paths.append((at, code.split("::")[0]))
    page.links.extend((line_of(m.start()), m.group(1)) for m in LINK.finditer(outside))
    page.loose_flags.extend((line_of(m.start()), m.group(1)) for m in PROSE_FLAG.finditer(outside))


def _closes(line: str, fence: str) -> bool:
    closing = re.fullmatch(r"\s*(`{3,}|~{3,})\s*", line)
    return closing is not None and closing.group(1)[0] == fence[0] and len(closing.group(1)) >= len(fence)


def _read(text: str) -> _Page:
    page, paragraph = _Page(), []
    fence, block, code_start = None, [], 0
    for number, line in enumerate(text.splitlines(), start=1):
        if fence is not None:
            if _closes(line, fence):
                page.events.extend(_code_lines(block))
                fence, block = None, []
            else:
                block.append((number, line))
        elif match := FENCE.match(line):
            _read_prose(page, paragraph)
            paragraph, fence, code_start = [], match.group(1), number
        elif heading := HEADING.match(line):
            _read_prose(page, paragraph)
            paragraph = []
            page.events.append(_Event(number, "heading", heading.group(1)))
            _read_prose(page, [(number, heading.group(1))])
        elif not line.strip():
            _read_prose(page, paragraph)
            paragraph = []
        else:
            paragraph.append((number, line))
    _read_prose(page, paragraph)
    if fence is not None:
        page.events.append(_Event(code_start, "unclosed", fence))
    page.events.sort(key=lambda e: (e.line, e.kind != "heading"))  # stable: spans of a line stay in order
    return page


def anchors(text: str) -> set[str]:
    """GitHub's anchors of a page's headings: lowercase, punctuation dropped, spaces to hyphens, repeats numbered."""
    seen: dict[str, int] = {}
    found = set()
    fence = None
    for line in text.splitlines():
        if fence is not None:
            fence = None if _closes(line, fence) else fence
        elif match := FENCE.match(line):
            fence = match.group(1)
        elif match := HEADING.match(line):
            title = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", match.group(1)).replace("`", "").replace("*", "")
            slug = re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")
            found.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
            seen[slug] = seen.get(slug, 0) + 1
    return found


# --- checking a page ---


def _check_commands(name: str, events: list[_Event], options: Options) -> list[Problem]:
    problems = []
    context: str | None = None  # the command named last in this section
    for event in events:
        if event.kind == "unclosed":
            problems.append(Problem(name, event.line, f"code block opened with {event.text} is never closed"))
        elif event.kind == "heading":
            context = None
        elif event.kind == "command":
            for command, arguments in _commands(event.text):
                known = options(command)
                if known is None:  # not a command of ours: `python -m pytest`, or a misspelt `swarmlm` one
                    if command.startswith("swarmlm ") and command.split()[1] not in ("-h", "--help"):
                        problems.append(Problem(name, event.line, f"unknown command `{command}`"))
                        context = None
                    continue
                context = command
                problems += [
                    Problem(name, event.line, f"`{command}` has no flag {flag}")
                    for flag in FLAG.findall(arguments)
                    if flag not in known
                ]
        elif context is None:
            flag = FLAG.findall(event.text)[0]
            problems.append(Problem(name, event.line, f"flag {flag} with no command named before it in its section"))
        else:
            known = options(context)
            problems += [
                Problem(name, event.line, f"flag {flag}: `{context}`, the last command named, has no such flag")
                for flag in FLAG.findall(event.text)
                if flag not in known
            ]
    return problems


def _check_links(path: Path, text: str, links: list[tuple[int, str]]) -> list[Problem]:
    name, problems = path.relative_to(REPO).as_posix(), []
    for line, target in links:
        if re.match(r"[a-z][a-z0-9+.-]*:", target):
            continue  # http:, https:, mailto:
        file, _, fragment = target.partition("#")
        page, page_text = path, text
        if file:
            page = (path.parent / file).resolve()
            if REPO not in (page, *page.parents) or not page.exists():
                problems.append(Problem(name, line, f"link to {target}: no such file in the repository"))
                continue
            page_text = page.read_text() if fragment and page.suffix == ".md" else ""
        if fragment and (page.suffix != ".md" or fragment not in anchors(page_text)):
            problems.append(Problem(name, line, f"link to {target}: no heading #{fragment} there"))
    return problems


def _check_paths(name: str, paths: list[tuple[int, str]]) -> list[Problem]:
    return [
        Problem(name, line, f"`{code}`: no such file or folder in the repository")
        for line, code in paths
        if not (any(REPO.glob(code.removeprefix("./"))) if "*" in code else (REPO / code).exists())
    ]


def check_page(path: Path, text: str, options: Options = options_for) -> list[Problem]:
    """Every problem of the page at `path` (inside the repository) whose text is `text`."""
    name = path.relative_to(REPO).as_posix()
    page = _read(text)
    return [
        *_check_commands(name, page.events, options),
        *(
            Problem(name, line, f"flag {flag} outside code: put it in backticks, next to its command")
            for line, flag in page.loose_flags
        ),
        *_check_links(path, text, page.links),
        *_check_paths(name, page.paths),
    ]


# --- the docs ---


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_commands_flags_links_and_paths_of_the_docs_exist(page):
    problems = check_page(page, page.read_text())
    assert not problems, "\n" + "\n".join(map(str, problems))


def test_the_readme_is_short_and_leads_to_every_page():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= README_MAX_LINES, f"README.md has {len(text.splitlines())} lines"
    linked = {target.split("#")[0] for _, target in _read(text).links}
    missing = [p.name for p in PAGES[1:] if f"docs/{p.name}" not in linked]
    assert not missing, f"README.md links to no {missing}"


def test_ci_runs_the_readmes_test_command():
    run = (REPO / ".ci" / "run").read_text().splitlines()[-1]
    assert run.startswith("bash .ci/setup && ")
    assert run in (REPO / "README.md").read_text().splitlines(), f"README.md does not show .ci/run's command: {run}"


# --- the checker itself, on samples ---

SAMPLE = REPO / "docs" / "sample.md"


def _problems(text: str) -> list[str]:
    return [str(p) for p in check_page(SAMPLE, text)]


def test_a_page_that_follows_the_rules_passes():
    text = (
        "# Title\n\n"
        "```bash\n"
        "# a comment --not-a-flag\n"
        "swarmlm peer MODEL --initial-peers /ip4/.../p2p/... \\\n"
        "    --blocks 0:15 --dtype bfloat16   # picks --nothing\n"
        "bash .ci/setup && .venv/bin/swarmlm demo --api | tee log\n"
        "python -m bench.soak --kill-every-s 200 300\n"
        "```\n\n"
        "Then `--minutes 4`, and with `swarmlm peer --help` the `--cache-tokens`\n"
        "flag; `python -m pytest -q --co` is not ours. See [the README](../README.md#two-commands), "
        "[top](#title), [figures](../bench/figures/) and `peer/cli.py`, `bench/figures/*.md`, `tests/integration/`.\n"
    )
    assert _problems(text) == []


def test_an_unknown_flag_of_a_command_is_named_with_its_file_and_line():
    text = "# T\n\n```bash\nswarmlm peer MODEL \\\n  --blocks 0:2 --no-such-flag\n```\n"
    assert _problems(text) == ["docs/sample.md:4: `swarmlm peer` has no flag --no-such-flag"]


def test_an_old_spelling_of_a_renamed_flag_is_refused():
    assert _problems("Run `swarmlm peer --session-timeout 5`.\n") == [
        "docs/sample.md:1: `swarmlm peer` has no flag --session-timeout"
    ]


def test_an_unknown_command_is_refused():
    assert _problems("```\nswarmlm serve MODEL\n```\n") == ["docs/sample.md:2: unknown command `swarmlm serve`"]


def test_a_bare_flag_belongs_to_the_last_command_named_in_its_section():
    text = "# A\n\n`swarmlm api --port 8000`, then `swarmlm status`\nand `--port`.\n\n# B\n\n`--port`\n"
    assert _problems(text) == [
        "docs/sample.md:4: flag --port: `swarmlm status`, the last command named, has no such flag",
        "docs/sample.md:8: flag --port with no command named before it in its section",
    ]


def test_flags_of_python_modules_come_from_their_source():
    text = "`python -m tests.mutations --list --only x` and `python -m bench.fuzz --kill-every-s 1`\n"
    assert _problems(text) == ["docs/sample.md:1: `python -m bench.fuzz` has no flag --kill-every-s"]


def test_a_flag_outside_code_is_refused():
    assert _problems("Pass --blocks to `swarmlm peer`.\n") == [
        "docs/sample.md:1: flag --blocks outside code: put it in backticks, next to its command"
    ]


def test_dead_links_anchors_and_paths_are_refused():
    text = (
        "# Title\n\n"
        "[a](missing.md) [b](../README.md#no-such-heading) [c](#nowhere) [d](../../outside.md)\n"
        "![e](../bench/figures/nothing.png) [f](https://example.com/x) and `peer/nothing.py`\n"
    )
    assert _problems(text) == [
        "docs/sample.md:3: link to missing.md: no such file in the repository",
        "docs/sample.md:3: link to ../README.md#no-such-heading: no heading #no-such-heading there",
        "docs/sample.md:3: link to #nowhere: no heading #nowhere there",
        "docs/sample.md:3: link to ../../outside.md: no such file in the repository",
        "docs/sample.md:4: link to ../bench/figures/nothing.png: no such file in the repository",
        "docs/sample.md:4: `peer/nothing.py`: no such file or folder in the repository",
    ]


def test_anchors_follow_github():
    text = "# The model's name in the DHT\n## `swarmlm status`\n## Robustness: fuzz, soak\n## Robustness: fuzz, soak\n"
    assert anchors(text) == {
        "the-models-name-in-the-dht",
        "swarmlm-status",
        "robustness-fuzz-soak",
        "robustness-fuzz-soak-1",
    }
