"""A headless Chromium driven by Selenium, for tests of web pages; skipped (saying how to install it) without one.

Selenium is pointed at the system's chromedriver explicitly, so that Selenium Manager never tries to download a
driver or a browser. Chromium and everything it spawns is stopped when the `with` ends, whatever happened.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest

from tests.helpers.processes import LeftoverProcessError, describe

CHROMIUM_CANDIDATES = ("/usr/bin/chromium", "/usr/bin/chromium-browser", "/usr/bin/google-chrome")
CHROMEDRIVER_CANDIDATES = ("/usr/bin/chromedriver", "/usr/lib/chromium/chromedriver")
INSTALL_HINT = (
    "install Chromium and its driver (Debian/Ubuntu: `apt-get install chromium chromium-driver`; "
    "`.ci/setup` does it as root on Debian) and selenium (`pip install -e .[test]`)"
)


def find_browser() -> tuple[str, str] | None:
    """(chromium, chromedriver) paths, or None where either is missing."""
    chromium = next((p for p in CHROMIUM_CANDIDATES if Path(p).is_file()), None) or shutil.which("chromium")
    driver = next((p for p in CHROMEDRIVER_CANDIDATES if Path(p).is_file()), None) or shutil.which("chromedriver")
    return (chromium, driver) if chromium and driver else None


def require_browser() -> tuple[str, str]:
    """(chromium, chromedriver), or skip the test saying how to install them."""
    pytest.importorskip("selenium", reason=f"selenium is not installed: {INSTALL_HINT}")
    found = find_browser()
    if found is None:
        pytest.skip(f"no Chromium or chromedriver on this machine: {INSTALL_HINT}")
    return found


@contextmanager
def headless_chromium(profile_dir: Path, *, width: int = 1400, height: int = 1000) -> Iterator:
    """A Selenium WebDriver for a headless Chromium with a fresh profile in `profile_dir`; quit on exit.

    Raises:
        LeftoverProcessError: a process of this browser (its command line names `profile_dir`) or the driver
            survived SIGKILL.
    """
    chromium, driver_path = require_browser()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile_dir.mkdir(parents=True, exist_ok=True)
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        f"--window-size={width},{height}",
        f"--user-data-dir={profile_dir}",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-default-apps",
        "--disable-extensions",
        "--disable-crash-reporter",
    ):
        options.add_argument(arg)
    service = Service(executable_path=driver_path)  # a path given: Selenium Manager is never asked
    try:
        driver = webdriver.Chrome(service=service, options=options)
        try:
            yield driver
        finally:
            driver.quit()  # stops Chromium, then the driver
    finally:
        _reap(profile_dir, service.process)


def _browser_processes(profile_dir: Path, driver: psutil.Popen | None) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        try:
            if proc.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            ours = str(profile_dir) in " ".join(proc.info["cmdline"] or ())
            if ours or (driver is not None and proc.pid == driver.pid):
                found.append(proc)
        except psutil.Error:
            continue
    return found


def _reap(profile_dir: Path, driver_popen, grace_s: float = 10.0) -> None:
    """Wait for the browser's processes to end (after quit), SIGKILL what is left, and fail if anything survives."""
    driver = None
    if driver_popen is not None and driver_popen.poll() is None:
        driver = psutil.Process(driver_popen.pid)
    deadline = time.monotonic() + grace_s
    while (left := _browser_processes(profile_dir, driver)) and time.monotonic() < deadline:
        time.sleep(0.2)
    for proc in left:
        try:
            proc.kill()
        except psutil.Error:
            continue
    if driver_popen is not None:
        try:
            driver_popen.wait(timeout=5)
        except Exception:
            pass
    gone_by = time.monotonic() + 10.0
    while (survivors := _browser_processes(profile_dir, None)) and time.monotonic() < gone_by:
        time.sleep(0.2)
    if survivors:
        raise LeftoverProcessError(f"browser processes survived SIGKILL:\n{describe(survivors)}")
