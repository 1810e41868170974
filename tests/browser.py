"""Debian's chromium + chromium-driver for the browser tests: found, or installed with apt where missing.

Playwright cannot download its browsers on these machines; Debian's packages can be installed. The
test set-up installs them (as root, or with passwordless sudo) once; a test is skipped, with the
reason, only where that is impossible.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

PACKAGES = ["chromium", "chromium-driver"]


def _find() -> tuple[str, str] | None:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    return (browser, driver) if browser and driver else None


def _apt(args: list[str]) -> subprocess.CompletedProcess:
    sudo = [] if os.geteuid() == 0 else ["sudo", "-n"]
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    return subprocess.run([*sudo, "apt-get", *args], env=env, capture_output=True, text=True, timeout=900)


def ensure_chromium() -> tuple[str, str] | str:
    """(chromium, chromedriver) paths, installing them if needed; or why they cannot be had."""
    found = _find()
    if found:
        return found
    if not shutil.which("apt-get"):
        return "chromium / chromium-driver are not installed and this machine has no apt-get"
    if os.geteuid() != 0 and subprocess.run(["sudo", "-n", "true"], capture_output=True).returncode != 0:
        return "chromium / chromium-driver are not installed, and installing them needs root (no passwordless sudo)"
    result = _apt(["install", "-y", "--no-install-recommends", *PACKAGES])
    if result.returncode != 0:  # a fresh machine may have no package lists yet
        _apt(["update"])
        result = _apt(["install", "-y", "--no-install-recommends", *PACKAGES])
    found = _find()
    if found:
        return found
    return f"apt-get install {' '.join(PACKAGES)} failed: {result.stderr.strip()[-500:]}"


def chrome(browser: str, driver: str, width: int = 1600, height: int = 1200):
    """A headless selenium Chrome session on Debian's chromium."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", f"--window-size={width},{height}"):
        options.add_argument(arg)
    return webdriver.Chrome(service=Service(driver), options=options)


def screenshot_dir() -> Path:
    """Where browser tests keep their screenshots (test output files): outputs/test-screenshots."""
    d = Path(os.environ.get("OMNIFLOW_TEST_OUTPUT", Path(__file__).resolve().parents[1] / "outputs" / "test-screenshots"))
    d.mkdir(parents=True, exist_ok=True)
    return d
