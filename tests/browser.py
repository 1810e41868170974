"""Debian's chromium + chromium-driver for the browser tests: found, or installed with apt where missing.

Playwright cannot download its browsers on these machines; Debian's packages can be installed. The
test set-up installs them (as root, or with passwordless sudo) once, in a fixture bounded on its own;
a test is skipped, with the reason, only where that is impossible (no apt, no root, no mirror reachable).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

PACKAGES = ["chromium", "chromium-driver"]


def _find() -> tuple[str, str] | None:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    return (browser, driver) if browser and driver else None


# apt's own messages when it cannot reach a mirror (no network, no DNS, a proxy that refuses).
_UNREACHABLE = (
    "Temporary failure resolving",
    "Could not resolve",
    "Failed to fetch",
    "Network is unreachable",
    "Could not connect",
    "Connection timed out",
    "Connection failed",
)
INSTALL_BOUND_S = 900.0  # apt-get update + install together, on a slow mirror


def _apt(args: list[str], timeout_s: float) -> subprocess.CompletedProcess:
    sudo = [] if os.geteuid() == 0 else ["sudo", "-n"]
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    cmd = [*sudo, "apt-get", *args]
    try:
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=max(timeout_s, 1.0))
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else exc.stdout or ""
        return subprocess.CompletedProcess(cmd, 124, out, f"apt-get {args[0]} timed out after {timeout_s:.0f}s")


def _unreachable(result: subprocess.CompletedProcess) -> bool:
    text = f"{result.stdout}\n{result.stderr}"
    return any(marker in text for marker in _UNREACHABLE)


def ensure_chromium(bound_s: float = INSTALL_BOUND_S) -> tuple[str, str] | str:
    """(chromium, chromedriver) paths, installing them with apt within `bound_s` seconds if needed.

    Returns a reason (a str) only where they cannot be had on this machine: no apt-get, no root, or
    apt cannot reach its mirrors. Any other failure of apt (a broken package, the bound exceeded)
    raises, so that the test fails instead of being skipped.
    """
    found = _find()
    if found:
        return found
    if not shutil.which("apt-get"):
        return "chromium / chromium-driver are not installed and this machine has no apt-get"
    if os.geteuid() != 0 and subprocess.run(["sudo", "-n", "true"], capture_output=True).returncode != 0:
        return "chromium / chromium-driver are not installed, and installing them needs root (no passwordless sudo)"
    deadline = time.monotonic() + bound_s
    install = ["install", "-y", "--no-install-recommends", *PACKAGES]
    result = _apt(install, deadline - time.monotonic())
    if result.returncode != 0:  # a fresh machine may have no (or stale) package lists
        update = _apt(["update"], deadline - time.monotonic())
        if update.returncode != 0 and _unreachable(update):
            return f"apt cannot reach its mirrors to install {' '.join(PACKAGES)}: {update.stderr.strip()[-500:]}"
        result = _apt(install, deadline - time.monotonic())
    found = _find()
    if found:
        return found
    if _unreachable(result):
        return f"apt cannot reach its mirrors to install {' '.join(PACKAGES)}: {result.stderr.strip()[-500:]}"
    raise RuntimeError(f"apt-get install {' '.join(PACKAGES)} failed ({result.returncode}): {result.stderr.strip()[-1500:]}")


def chrome(browser: str, driver: str, width: int = 1600, height: int = 1200):
    """A headless selenium Chrome session on Debian's chromium."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", f"--window-size={width},{height}"):
        options.add_argument(arg)
    return webdriver.Chrome(service=Service(driver), options=options)


def screenshot_dir(root: Path) -> Path:
    """Where a browser test keeps its screenshots: a folder in its own temp dir (`root`)."""
    d = Path(root) / "screenshots"
    d.mkdir(parents=True, exist_ok=True)
    return d


def wait_for_text(driver, texts: list[str], timeout_s: float = 60) -> str:
    """The page's text once it shows every one of `texts` (polled); fails naming the missing ones."""
    from selenium.webdriver.common.by import By

    deadline = time.monotonic() + timeout_s
    body = ""
    while time.monotonic() < deadline:
        body = driver.find_element(By.TAG_NAME, "body").text
        if all(t in body for t in texts):
            return body
        time.sleep(0.5)
    raise AssertionError(f"page never showed {[t for t in texts if t not in body]}; it shows:\n{body[:2000]}")


def open_tab(driver, name: str) -> None:
    """Click the Prefect UI tab labelled `name`."""
    from selenium.webdriver.common.by import By

    tab = next(e for e in driver.find_elements(By.CSS_SELECTOR, "li.p-tab") if e.text.strip() == name)
    tab.click()
