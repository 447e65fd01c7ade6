"""Dark mode follows the system setting: with ``prefers-color-scheme: dark`` (emulated in
headless Chromium) the pages are dark, and every piece of text, link, button and badge keeps
a contrast of at least 4.5:1 (WCAG AA) against what it is drawn on; the light pages stay light.
Screenshots are kept in artifacts/.

Needs Debian's ``chromium`` and ``chromium-driver`` packages; skipped where they are missing."""

from __future__ import annotations

import pytest
from django.urls import reverse

from tests.browser import log_in, needs_chromium, screenshot
from tests.webapp.dashboard.factories import make_answers, make_document
from tests.webapp.dashboard.test_browser import browser  # noqa: F401 - a fixture
from webapp.documents.services import collection_create, collection_set_documents

pytestmark = [pytest.mark.django_db(transaction=True), needs_chromium]


# For each visible element with text of its own: [description, contrast ratio] against the
# first opaque background among it and its ancestors (WCAG's relative luminance).
CONTRASTS = """
const rgb = s => (s.match(/[\\d.]+/g) || []).map(Number);
const lum = ([r, g, b]) => {
  const c = [r, g, b].map(v => (v /= 255) <= 0.03928 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4);
  return 0.2126 * c[0] + 0.7152 * c[1] + 0.0722 * c[2];
};
const background = el => {
  for (; el; el = el.parentElement) {
    const c = rgb(getComputedStyle(el).backgroundColor);
    if (c.length === 3 || (c.length === 4 && c[3] > 0.5)) return c;
  }
  return rgb(getComputedStyle(document.documentElement).backgroundColor);
};
const out = [];
for (const el of document.querySelectorAll("body *")) {
  const own = [...el.childNodes].some(n => n.nodeType === 3 && n.textContent.trim());
  if (!own || !el.getClientRects().length || el.closest("svg, script, style, option")) continue;
  const [a, b] = [lum(rgb(getComputedStyle(el).color)), lum(background(el))];
  const ratio = (Math.max(a, b) + 0.05) / (Math.min(a, b) + 0.05);
  out.push([el.tagName + "." + el.className + ": " + el.textContent.trim().slice(0, 30), ratio]);
}
return out;
"""
BODY_LUMINANCE = """
const [r, g, b] = getComputedStyle(document.body).backgroundColor.match(/\\d+/g).map(Number);
return (0.2126 * r + 0.7152 * g + 0.0722 * b) / 255;
"""


def _pages(staff) -> dict[str, str]:
    document = make_document(staff, "Harbour handbook", chunks=2)
    conversation = make_answers(staff, document)[0].conversation
    collection = collection_create(owner=staff, name="Harbours")
    collection_set_documents(collection=collection, document_ids=[document.id])
    return {
        "collection": reverse("documents:collection", args=[collection.id]),
        "chat": reverse("chat:conversation", args=[conversation.id]),
        "documents": reverse("documents:list"),
        "document": reverse("documents:detail", args=[document.id]),
        "dashboard": reverse("dashboard:index"),
        "api-keys": reverse("api_keys"),
    }


def test_dark_mode_follows_the_system_and_keeps_text_readable(
    browser,  # noqa: F811
    live_server,
    staff,
) -> None:
    pages = _pages(staff)
    log_in(browser, live_server.url, staff)
    browser.get(f"{live_server.url}{pages['documents']}")
    assert browser.execute_script(BODY_LUMINANCE) > 0.9  # light unless the system says dark

    browser.execute_cdp_cmd(
        "Emulation.setEmulatedMedia",
        {"features": [{"name": "prefers-color-scheme", "value": "dark"}]},
    )
    for name, url in pages.items():
        browser.get(f"{live_server.url}{url}")
        assert browser.execute_script(BODY_LUMINANCE) < 0.15, name
        contrasts = browser.execute_script(CONTRASTS)
        assert len(contrasts) > 10, name
        poor = [(what, round(ratio, 2)) for what, ratio in contrasts if ratio < 4.5]
        assert not poor, f"{name}: text below 4.5:1 in dark mode: {poor}"
        screenshot(browser, f"dark-{name}.png")
