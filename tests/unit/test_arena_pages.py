"""The arena pages' shell as a browser first meets it: an icon of their own (no 404 for
/favicon.ico in every page's log) and, on the board, what Rating and Elo each are."""

from __future__ import annotations

import re

from tests.unit.fake_pipeline import gateway


def test_each_page_links_an_icon_that_is_served_without_a_key():
    with gateway(api_keys=["sk-test-key-0123456789"])[0] as client:
        for page in ("/arena", "/arena/board"):
            icon = re.search(r'<link rel="icon" href="([^"]+)"', client.get(page).text)
            assert icon, page
            r = client.get(icon.group(1))
            assert r.status_code == 200 and r.headers["content-type"].startswith("image/svg+xml")
            assert r.text.startswith("<svg")


def test_the_board_says_what_rating_and_elo_are():
    with gateway()[0] as client:
        page = client.get("/arena/board").text
    note = re.search(r'<p class="hint" id="rating-note">(.*?)</p>', page, re.S)
    assert note and "Bradley–Terry" in note.group(1) and "online Elo" in note.group(1)
    assert 'title="Bradley–Terry rating' in page and 'title="Online Elo' in page  # the columns' tooltips
