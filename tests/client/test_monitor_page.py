"""The monitor's page as files: self-contained (nothing from another origin) and built from text, never markup."""

from __future__ import annotations

import re

import pytest

from client.monitor.app import static_file

FILES = ("index.html", "monitor.js", "monitor.css")


@pytest.mark.parametrize("name", FILES)
def test_the_page_loads_nothing_from_elsewhere(name):
    text = static_file(name)
    assert not re.search(r"(https?:)?//[a-z0-9.-]+\.[a-z]{2,}", text, re.IGNORECASE), f"{name} names another origin"
    assert "@import" not in text and "url(" not in text


def test_the_script_never_parses_markup():
    script = static_file("monitor.js")
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function"):
        assert sink not in script, sink
    # the page's own markup holds no inline script or style, which the Content-Security-Policy would refuse
    html = static_file("index.html")
    assert re.findall(r"<script[^>]*>", html) == ['<script src="/monitor.js" defer>'] and "style=" not in html
