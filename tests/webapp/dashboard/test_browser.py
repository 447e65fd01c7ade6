"""The dashboard in a real browser (headless Chromium): it renders with live data, the htmx
poll refreshes the tiers panel, and a screenshot is kept as a test artifact.

Needs Debian's ``chromium`` and ``chromium-driver`` packages (and the ``selenium`` dev
extra); skipped, with the reason, where they are missing."""

from __future__ import annotations

import json
import queue
import time

import pytest
import torch
from django.test import Client

from kvservice.protocol.codecs import DEFAULT_CODEC
from tests.browser import (
    ARTIFACTS,
    CHROMIUM,  # noqa: F401 - other browser tests import it from here
    log_in,
    needs_chromium,
    start_chromium,
)
from tests.webapp.dashboard.factories import make_answers, make_document
from webapp.dashboard.models import FidelityAudit
from webapp.documents.models import Chunk

pytestmark = [pytest.mark.django_db(transaction=True), needs_chromium]


@pytest.fixture
def browser():
    driver = start_chromium()
    yield driver
    driver.quit()


def _log_in(browser, live_server, user) -> None:
    log_in(browser, live_server.url, user)


def _with_real_rows(staff, alice) -> None:
    document = make_document(alice, "Rivers of Europe", chunks=6)
    make_document(alice, "Moons of Jupiter", chunks=4)
    answers = make_answers(alice, document) + make_answers(staff, document)
    for answer, f1 in zip(
        [a for a in answers if a.mode == "blend"], [0.91, 0.74, 1.0, 0.83], strict=False
    ):
        FidelityAudit.objects.create(
            message=answer,
            blend_text=answer.content,
            full_text="x",
            token_f1=f1,
            status="done",
            completed_at=answer.completed_at,
            blend_recompute_ratio=answer.recompute_ratio,
        )


def test_dashboard_renders_polls_and_is_screenshotted(
    browser, live_server, staff, alice, worker_heartbeat
) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    _with_real_rows(staff, alice)
    _log_in(browser, live_server, staff)
    browser.get(f"{live_server.url}/dashboard/")
    assert "Operator dashboard" in browser.find_element(By.TAG_NAME, "h1").text
    rows = browser.find_elements(By.CSS_SELECTOR, "#tier-table tbody tr")
    assert [r.get_attribute("id") for r in rows] == ["tier-cpu", "tier-disk"]
    charts = browser.find_elements(By.CSS_SELECTOR, "svg.chart")
    assert len(charts) == 6 and all(c.size["height"] > 100 for c in charts)

    # The live panel is replaced by htmx's poll (a new element, same content).
    old_panel = browser.find_element(By.ID, "live")
    browser.execute_script("arguments[0].setAttribute('data-stale', '1')", old_panel)
    WebDriverWait(browser, 15).until(
        lambda b: b.find_element(By.ID, "live").get_attribute("data-stale") is None
    )
    assert browser.find_element(By.ID, "tier-disk").is_displayed()

    for _ in range(2):  # the page reflows once the window is tall
        height = browser.execute_script("return document.documentElement.scrollHeight")
        browser.set_window_size(1280, min(height + 120, 8000))
        time.sleep(0.3)
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / "dashboard.png"
    assert browser.save_screenshot(str(path))
    assert path.stat().st_size > 50_000


@pytest.mark.slow
def test_dashboard_with_the_real_workers_evict_warm_and_screenshot(
    browser, live_server, celery_worker_process, inference_worker_process, django_user_model
) -> None:
    """Real answers in every mode, an audit, an eviction and a warm-up through the real
    inference worker, then the dashboard as an operator sees it."""
    from django.test import TestCase
    from django.urls import reverse

    from kvservice.protocol.heartbeat import read_heartbeat
    from tests.conftest import wait_for
    from tests.e2e.test_chat_e2e import collect_stream, upload_ready
    from webapp.chat import services as chat
    from webapp.dashboard import selectors
    from webapp.redis import redis_client

    staff = django_user_model.objects.create_user(username="ops-shot", password="x", is_staff=True)
    texts = {
        "harbour.txt": "The harbour of Velmont was dug in 1764. Its breakwater is 900 metres "
        "long, and the lighthouse at its end shows a green light every four seconds.",
        "canal.txt": "The Orlen canal links Velmont to the river Sau. Barges carry grain and "
        "timber on it; the journey takes two days through eleven locks.",
    }
    documents = [upload_ready(staff, text, name) for name, text in texts.items()]
    client = Client()
    client.force_login(staff)
    client.post(reverse("dashboard:audit"), {"sample_rate": "1"})

    def cpu_entries(after: float = 0.0) -> int | None:
        """CPU-tier entries in the worker's heartbeat (one written after ``after``: the
        heartbeat comes every few seconds, so an older one may predate the last promotion)."""
        beat = read_heartbeat(redis_client())
        if beat is None or beat["ts"] <= after:
            return None
        tiers = {t["name"]: t for t in selectors.tier_rows(beat)}
        return tiers.get("cpu", {}).get("entries")

    # The worker is shared by the whole session (other tests' chunks may sit in its tiers),
    # so the checks below count relative to what is there.
    conversation = chat.conversation_create(owner=staff)
    questions = [
        "How long is the Velmont breakwater?",
        "What do barges carry on the canal?",
        "When was the harbour dug?",
        "How many locks does the canal have?",
    ]
    for question, mode in zip(questions, ["blend", "blend", "reuse", "full"], strict=True):
        with TestCase.captureOnCommitCallbacks(execute=True):
            answer = chat.chat_ask(
                user=staff, conversation=conversation, question=question, mode=mode
            )
        assert collect_stream(str(answer.request_id))[1] == "done"
    # Each question retrieves the one-chunk document it asks about; the first two, in blend,
    # read each chunk from the store and promote it into CPU memory (the questions after them
    # find their passage in the prefix cache, or read none). Evicting the two documents
    # removes two entries, warming adds one.
    answered = time.time() + 1.0  # promotion finishes just after the stream does
    before = wait_for(lambda: cpu_entries(after=answered), timeout=20, what="a fresh heartbeat")
    assert before >= len(documents)
    client.post(reverse("dashboard:document_evict", args=[documents[0].pk]))
    client.post(reverse("dashboard:document_evict", args=[documents[1].pk]))
    wait_for(lambda: (cpu_entries() or 0) <= before - 2, timeout=20, what="the eviction")
    evicted = cpu_entries() or 0
    client.post(reverse("dashboard:document_warm", args=[documents[1].pk]), {"tier": "cpu"})
    wait_for(lambda: (cpu_entries() or 0) >= evicted + 1, timeout=20, what="the warm-up into CPU")

    _log_in(browser, live_server, staff)
    browser.get(f"{live_server.url}/dashboard/")
    for _ in range(2):
        height = browser.execute_script("return document.documentElement.scrollHeight")
        browser.set_window_size(1280, min(height + 120, 8000))
        time.sleep(0.3)
    page = browser.page_source
    assert "inference worker up" in page and "canal.txt" in page
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / "dashboard-live.png"
    assert browser.save_screenshot(str(path)) and path.stat().st_size > 50_000


def test_an_operator_sets_a_fidelity_target_and_sees_the_ratio_it_gives(
    browser, live_server, staff, settings, tmp_path
) -> None:
    """The target is chosen in the controller form like a person would (radio, number, Save);
    the page then says which ratio the measured curve gives it and the live panel shows it."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    from tests.webapp.dashboard.test_target import CURVE
    from webapp.dashboard import selectors

    path = tmp_path / "curve.json"
    # measured with the codec the store writes (the bench records it)
    path.write_text(json.dumps({"modes": {}, "curve": CURVE, "env": {"kv_codec": DEFAULT_CODEC}}))
    settings.RATIO_CURVE_PATH = path
    _log_in(browser, live_server, staff)
    browser.get(f"{live_server.url}/dashboard/")
    form = browser.find_element(By.ID, "controller-form")
    form.find_element(By.CSS_SELECTOR, 'input[name="mode"][value="target"]').click()
    target = form.find_element(By.CSS_SELECTOR, 'input[name="fidelity_target"]')
    target.clear()
    target.send_keys("0.04")
    form.find_element(By.CSS_SELECTOR, 'button[type="submit"]').click()

    saved = WebDriverWait(browser, 15).until(
        lambda b: b.find_elements(By.CSS_SELECTOR, "ul.messages")
    )
    assert "at least 0.100" in saved[0].text
    assert selectors.fidelity_target() == 0.04
    assert selectors.target_ratio() == pytest.approx(0.1)
    checked = browser.find_element(By.CSS_SELECTOR, 'input[name="mode"][value="target"]')
    assert checked.is_selected()
    assert "from a ratio of 0.100" in browser.find_element(By.ID, "target-ratio").text
    setting = browser.find_element(By.ID, "controller-setting").text
    assert setting == "fidelity target: mean KL to full ≤ 0.0400"
    ARTIFACTS.mkdir(exist_ok=True)
    assert browser.save_screenshot(str(ARTIFACTS / "dashboard-target.png"))


def test_an_operator_sets_a_target_that_progressive_blend_meets_first(
    browser, live_server, staff, settings, tmp_path
) -> None:
    """With a curve that measured progressive blend, the operator sets a fidelity target
    and progressive blend's upgrade in the form; the page says the first-token ratio and the
    upgrade the curve gives, the live panel the setting."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    from tests.webapp.dashboard.test_target import CURVE, PROGRESSIVE
    from webapp.dashboard import selectors

    path = tmp_path / "curve.json"
    curve = {"modes": {}, "curve": [*CURVE, *PROGRESSIVE], "env": {"kv_codec": DEFAULT_CODEC}}
    path.write_text(json.dumps(curve))
    settings.RATIO_CURVE_PATH = path
    _log_in(browser, live_server, staff)
    browser.get(f"{live_server.url}/dashboard/")
    form = browser.find_element(By.ID, "controller-form")
    form.find_element(By.CSS_SELECTOR, 'input[name="mode"][value="target"]').click()
    for name, value in (("fidelity_target", "0.03"), ("refresh_ratio", "0.25")):
        field = form.find_element(By.CSS_SELECTOR, f'input[name="{name}"]')
        field.clear()
        field.send_keys(value)
    form.find_element(By.CSS_SELECTOR, 'button[type="submit"]').click()

    saved = WebDriverWait(browser, 15).until(
        lambda b: b.find_elements(By.CSS_SELECTOR, "ul.messages")
    )
    assert "at least 0.100, upgraded to 0.25 after the first token" in saved[0].text
    assert selectors.target_plan() == (pytest.approx(0.1), 0.25)
    shown = browser.find_element(By.ID, "target-ratio").text
    assert "from a ratio of 0.100, upgraded to 0.25 after the first token" in shown
    assert "upgrade to 0.25" in browser.find_element(By.ID, "refresh-setting").text
    refresh = browser.find_element(By.CSS_SELECTOR, 'input[name="refresh_ratio"]')
    assert refresh.get_attribute("value") == "0.25"
    rings = browser.find_elements(By.CSS_SELECTOR, "#ratio-curve g.marker-progressive")
    assert len(rings) == len(PROGRESSIVE)
    ARTIFACTS.mkdir(exist_ok=True)
    assert browser.save_screenshot(str(ARTIFACTS / "dashboard-progressive.png"))


def test_the_dashboard_reads_at_desktop_and_phone_width(
    live_server, staff, alice, worker_heartbeat, settings
) -> None:
    """The measured curves (the repository's, three codecs) drawn at a readable size with the
    whole legend inside the chart, each table's meanings below it, and on a phone the tables
    scroll sideways instead of squeezing each column to a letter a line."""
    from selenium.webdriver.common.by import By

    settings.RATIO_CURVE_PATH = settings.BASE_DIR / "docs" / "ratio_curve.json"
    _with_real_rows(staff, alice)
    for name, width in (("desktop", 1280), ("phone", 390)):
        driver = start_chromium("--hide-scrollbars")
        try:
            driver.execute_cdp_cmd(
                "Emulation.setDeviceMetricsOverride",
                {"width": width, "height": 900, "deviceScaleFactor": 1, "mobile": False},
            )
            _log_in(driver, live_server, staff)
            driver.get(f"{live_server.url}/dashboard/")
            curve = driver.find_element(By.CSS_SELECTOR, "#ratio-curve svg.chart")
            assert curve.size["width"] >= min(600, width - 60), (name, curve.size)
            # every legend entry inside the drawing (a long codec name once ran off it)
            overflow = driver.execute_script(
                "const svg = arguments[0], right = svg.viewBox.baseVal.width,"
                " bottom = svg.viewBox.baseVal.height;"
                " return [...svg.querySelectorAll('text')].filter(t => { const b = t.getBBox();"
                " return b.x + b.width > right + 1 || b.y + b.height > bottom + 1; })"
                ".map(t => t.textContent);",
                curve,
            )
            assert overflow == [], (name, overflow)
            assert len(driver.find_elements(By.CSS_SELECTOR, "dl.meanings")) >= 5
            if name == "phone":  # each chart at its drawn size (11 px labels), not squeezed
                scales = driver.execute_script(
                    "return [...document.querySelectorAll('svg.chart')].map(s =>"
                    " s.getBoundingClientRect().width / s.viewBox.baseVal.width)"
                )
                assert len(scales) >= 5 and min(scales) >= 0.99, scales
            scroll_width, inner = driver.execute_script(
                "return [document.scrollingElement.scrollWidth, window.innerWidth]"
            )
            assert scroll_width <= inner, (name, scroll_width, inner)
            # a column heading on one line, at any width
            heading = driver.find_element(By.CSS_SELECTOR, "#tier-table thead th:nth-child(6)")
            line = driver.execute_script(
                "return parseFloat(getComputedStyle(arguments[0]).lineHeight)", heading
            )
            assert heading.size["height"] < 2 * line, (name, heading.size, line)
            ARTIFACTS.mkdir(exist_ok=True)
            assert driver.save_screenshot(str(ARTIFACTS / f"dashboard-{name}.png"))
            assert curve.screenshot(str(ARTIFACTS / f"dashboard-curve-{name}.png"))
        finally:
            driver.quit()


def _full_page_png(driver, width: int, height: int) -> bytes:
    """The whole page (not just the window) at ``width`` CSS px, as Chromium draws it."""
    import base64

    driver.execute_cdp_cmd(
        "Emulation.setDeviceMetricsOverride",
        {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False},
    )
    tall = driver.execute_script("return document.documentElement.scrollHeight")
    shot = driver.execute_cdp_cmd(
        "Page.captureScreenshot",
        {
            "captureBeyondViewport": True,
            "clip": {"x": 0, "y": 0, "width": width, "height": tall, "scale": 1},
        },
    )
    return base64.b64decode(shot["data"])


def test_the_whole_dashboard_is_screenshotted_as_a_new_operator_sees_it(
    live_server, staff, alice, worker_heartbeat, settings
) -> None:
    """The full page at desktop (1280x800) and phone (390x844) width, with the worker's
    engine and batch state in its heartbeat and the repository's measured curves: the
    screenshots (artifacts/dashboard-page-*.png) are what a reviewer reads the page by."""
    from kvservice.blend.controller import LoadingController
    from kvservice.model.kernels import KernelChoice
    from kvservice.protocol.heartbeat import write_heartbeat
    from kvservice.serve.batcher import ContinuousBatcher, StepBudget
    from kvservice.store.buffers import BufferPool
    from webapp.redis import redis_client

    pool = BufferPool(limit_bytes=64 << 20)
    pool.empty((2, 1 << 20), torch.float32)
    pool.empty((2, 1 << 20), torch.float32)
    batcher = ContinuousBatcher.__new__(ContinuousBatcher)  # its stats alone: no model
    batcher._jobs, batcher._work, batcher._waiting = [object()], None, []
    batcher._incoming = queue.Queue()
    batcher.steps, batcher.slices, batcher.upgrades_skipped, batcher._decode_s = 40, 12, 0, 0.05
    batcher.longest_piece_s, batcher.budget, batcher.upgrades_dropped = 0.2, StepBudget(), 0
    batcher.slot_allocations, batcher.compactions = 1, 0
    controller = LoadingController(r_min=0.15)  # its first decision came before a measurement
    controller.choose(num_tokens=1500, num_layers=30, load_bytes_by_tier={"cpu": 2**20})
    controller.observe_recompute(tokens=512, layers=30, seconds=0.02)
    kernels = KernelChoice("onednn-bf16", "auto", {}, {}, True, torch.bfloat16).to_dict()
    shape = {"layers": 30, "kv_heads": 3, "head_dim": 64}  # the bundled model's, as it reports
    write_heartbeat(
        redis_client(),
        **{**worker_heartbeat, "controller": controller.snapshot()},
        model_shape=shape,
        kernels=kernels,
        pass_graphs={"on": False},
        buffers=pool.stats(),
        batch=batcher.stats(),
    )
    settings.RATIO_CURVE_PATH = settings.BASE_DIR / "docs" / "ratio_curve.json"
    _with_real_rows(staff, alice)
    Chunk.objects.update(kv_bytes=20 * 2_880)  # 20 tokens a chunk, stored at 2,880 B a token
    driver = start_chromium("--hide-scrollbars")
    try:
        _log_in(driver, live_server, staff)
        driver.get(f"{live_server.url}/dashboard/")
        ARTIFACTS.mkdir(exist_ok=True)
        for name, (width, height) in {"desktop": (1280, 800), "phone": (390, 844)}.items():
            path = ARTIFACTS / f"dashboard-page-{name}.png"
            path.write_bytes(_full_page_png(driver, width, height))
            assert path.stat().st_size > 50_000, path
    finally:
        driver.quit()
