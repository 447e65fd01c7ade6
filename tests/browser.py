"""Headless Chromium for the browser tests: one way to start it, to skip where it is missing,
to log a user in, and to keep a screenshot in artifacts/.

Needs Debian's ``chromium`` and ``chromium-driver`` packages (and the ``selenium`` dev extra)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings as django_settings
from django.test import Client

CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"

needs_chromium = pytest.mark.skipif(
    not CHROMIUM.exists() or not shutil.which("chromedriver"),
    reason="headless Chromium is not installed: apt-get install -y chromium chromium-driver",
)


def start_chromium(*arguments: str, console_log: bool = False) -> Any:
    """A headless Chromium driver (1280x1000 unless ``arguments`` name a --window-size);
    ``console_log``: keep the page's console for ``driver.get_log("browser")``."""
    webdriver = pytest.importorskip("selenium.webdriver", reason="pip install -e '.[dev]'")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    sized = any(a.startswith("--window-size=") for a in arguments)
    for argument in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--disable-gpu",
        *([] if sized else ["--window-size=1280,1000"]),
        *arguments,
    ):
        options.add_argument(argument)
    if console_log:
        options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(shutil.which("chromedriver")))
    driver.set_page_load_timeout(60)
    return driver


def start_phone(*, scale: int = 2, mobile: bool = False) -> Any:
    """A headless Chromium with a fixed 390x844 viewport. ``mobile=False``: a desktop window
    is at least 500 px wide, and mobile emulation zooms out to fit an overflowing page
    (innerWidth then grows with it); ``mobile=True`` for a page without a viewport meta tag,
    laid out 980 px wide and zoomed out as a phone's browser does."""
    driver = start_chromium("--hide-scrollbars")
    driver.execute_cdp_cmd(
        "Emulation.setDeviceMetricsOverride",
        {"width": 390, "height": 844, "deviceScaleFactor": scale, "mobile": mobile},
    )
    return driver


def log_in(driver: Any, base_url: str, user: Any) -> None:
    """``user``'s session cookie in the browser, without the login form."""
    client = Client()
    client.force_login(user)
    driver.get(f"{base_url}/healthz")  # a page of the site, to set its cookie on
    driver.add_cookie(
        {
            "name": django_settings.SESSION_COOKIE_NAME,
            "path": "/",
            "value": client.cookies[django_settings.SESSION_COOKIE_NAME].value,
        }
    )


def screenshot(driver: Any, name: str) -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / name
    assert driver.save_screenshot(str(path))
    return path


def click_and_wait_for_next_page(driver: Any, element: Any, timeout: float = 30) -> None:
    """Click ``element`` (a link or a form's button) and wait until its page is gone.

    Selenium's ``staleness_of`` waits for a StaleElementReferenceException only; while the
    next page loads, Chromium may answer the same question with "Node with given id does not
    belong to the document" instead (seen under load), which ends the wait with an error."""
    from selenium.common.exceptions import WebDriverException
    from selenium.webdriver.support.ui import WebDriverWait

    def gone(_driver: Any) -> bool:
        try:
            element.is_enabled()
        except WebDriverException:  # stale, or mid-navigation
            return True
        return False

    element.click()
    WebDriverWait(driver, timeout).until(gone)


# An answer the page shows recorded (a stopped one too).
ANSWER_DONE = ".msg.assistant[data-status=done], .msg.assistant[data-status=stopped]"


def ask(driver: Any, question: str, timeout: float = 60) -> Any:
    """Ask ``question`` in the open conversation with the keyboard; the answer's element
    once the page shows it recorded."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    from tests.conftest import wait_for

    before = len(driver.find_elements(By.CSS_SELECTOR, ANSWER_DONE))
    driver.find_element(By.NAME, "question").send_keys(question, Keys.ENTER)
    wait_for(
        lambda: len(driver.find_elements(By.CSS_SELECTOR, ANSWER_DONE)) > before,
        timeout=timeout,
        what=f"the answer to {question!r}",
    )
    return driver.find_elements(By.CSS_SELECTOR, ANSWER_DONE)[-1]


def open_citation(driver: Any, answer: Any) -> str:
    """Click ``answer``'s [1]; the highlighted text, once the citation panel has scrolled
    it into view."""
    from selenium.webdriver.common.by import By

    from tests.conftest import wait_for

    driver.execute_script("document.getElementById('citation-panel').innerHTML = ''")
    answer.find_element(By.CSS_SELECTOR, "a.cite").click()
    mark = wait_for(
        lambda: driver.find_elements(By.CSS_SELECTOR, "#citation-panel mark.cited-sentence"),
        timeout=15,
        what="the highlighted passage",
    )[0]
    in_view = (
        "const m = arguments[0].getBoundingClientRect();"
        "const p = document.getElementById('citation-overlay').getBoundingClientRect();"
        "return m.top >= p.top && m.bottom <= p.bottom"
    )
    wait_for(
        lambda: driver.execute_script(in_view, mark),
        timeout=5,
        what="the panel to scroll to the highlight",
    )
    return mark.text
