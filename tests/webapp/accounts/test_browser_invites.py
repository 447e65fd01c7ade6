"""Invites in a real browser (headless Chromium, #18): a staff member makes a link from the
Users page, the person it is for opens it, picks a username and password and is signed in; the
link then shows the styled "used" page; the pages fit a phone (390 px). Screenshots are kept
in artifacts/.

Needs Debian's ``chromium`` and ``chromium-driver`` packages; skipped where they are missing."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.auth import get_user_model
from django.utils import timezone

from tests.browser import click_and_wait_for_next_page, log_in, needs_chromium, screenshot
from tests.webapp.dashboard.test_browser import browser  # noqa: F401 - a fixture
from tests.webapp.ui.test_mobile import _overflow, phone  # noqa: F401 - phone is a fixture
from webapp.accounts import services
from webapp.accounts.models import Invite

pytestmark = [pytest.mark.django_db(transaction=True), needs_chromium]

PASSWORD = "Quiet-river-2041"


def _submit(driver, selector: str) -> None:
    """Click a form's button and wait for the page it loads."""
    from selenium.webdriver.common.by import By

    click_and_wait_for_next_page(driver, driver.find_element(By.CSS_SELECTOR, selector))


def test_an_invite_from_staff_to_a_signed_in_account(browser, live_server, staff) -> None:  # noqa: F811
    from selenium.webdriver.common.by import By

    log_in(browser, live_server.url, staff)
    browser.get(f"{live_server.url}/accounts/users/")
    browser.find_element(By.ID, "invites-link").click()
    browser.find_element(By.ID, "id_email").send_keys("nina@example.org")
    _submit(browser, "#invite-form button")
    link = browser.find_element(By.ID, "invite-link").get_attribute("value")
    assert link.startswith(f"{live_server.url}/accounts/invite/")
    assert "nina@example.org" in browser.find_element(By.ID, "invite-list").text
    screenshot(browser, "invites-staff.png")

    browser.delete_all_cookies()  # the person invited, not signed in
    browser.get(link)
    assert browser.find_element(By.TAG_NAME, "h1").text == "Create your account"
    browser.find_element(By.ID, "id_username").send_keys("nina")
    browser.find_element(By.ID, "id_password1").send_keys(PASSWORD)
    browser.find_element(By.ID, "id_password2").send_keys(PASSWORD)
    screenshot(browser, "invite-accept.png")
    _submit(browser, "#invite-accept-form button")
    assert browser.find_element(By.CSS_SELECTOR, ".topbar .who").text == "nina"
    assert "Welcome, nina" in browser.find_element(By.CSS_SELECTOR, ".messages").text
    nina = get_user_model().objects.get(username="nina")
    assert nina.email == "nina@example.org" and not nina.is_staff

    browser.delete_all_cookies()
    browser.get(link)  # once only
    card = browser.find_element(By.ID, "invite-refused")
    assert browser.find_element(By.TAG_NAME, "h1").text == "This invite link has been used"
    assert card.value_of_css_property("border-top-left-radius") == "10px"  # app.css applied
    screenshot(browser, "invite-used.png")


def test_the_invite_pages_fit_a_phone(phone, live_server, staff) -> None:  # noqa: F811
    from selenium.webdriver.common.by import By

    long_email = "someone.with.a.rather.long.name@example.org"
    _, used = services.invite_create(created_by=staff, email=long_email)
    Invite.objects.update(used_at=timezone.now())
    ended, expired = services.invite_create(created_by=staff, username="a-rather-long-username")
    Invite.objects.filter(pk=ended.pk).update(expires_at=timezone.now() - timedelta(days=1))
    _, fresh = services.invite_create(created_by=staff)

    pages = {
        "invite-accept": f"/accounts/invite/{fresh}/",
        "invite-used": f"/accounts/invite/{used}/",
        "invite-expired": f"/accounts/invite/{expired}/",
    }
    widths = {}
    for name, path in pages.items():
        phone.get(f"{live_server.url}{path}")
        widths[name] = _overflow(phone)
        screenshot(phone, f"phone-{name}.png")
    assert phone.find_element(By.TAG_NAME, "h1").text == "This invite link has expired"

    log_in(phone, live_server.url, staff)
    phone.get(f"{live_server.url}/accounts/invites/")
    _submit(phone, "#invite-form button")  # the page with a new link on it
    assert phone.find_element(By.ID, "invite-link").is_displayed()
    widths["invites"] = _overflow(phone)
    screenshot(phone, "phone-invites.png")
    wide = {name: w for name, w in widths.items() if w[0] > w[1]}
    assert not wide, f"wider than the screen (scrollWidth, innerWidth): {wide}"
