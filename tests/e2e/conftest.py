"""Fixtures of the end-to-end tests that more than one module uses."""

from __future__ import annotations

import pytest

CHROMIUM = "/usr/bin/chromium"  # Debian's package (.ci/run installs it); no browser download


@pytest.fixture(scope="module")
def browser():
    """A real headless chromium (Playwright driving Debian's binary)."""
    from playwright.sync_api import sync_playwright  # a missing package fails the test, not skips it

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield b
        b.close()
