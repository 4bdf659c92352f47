"""Headless Chromium for the UI tests (Debian chromium + chromium-driver through selenium; scripts/setup.sh
installs them on the test path, the tests install nothing)."""

from __future__ import annotations

import shutil
import time

import pytest

CHROMEDRIVER = shutil.which("chromedriver")


def chromium():
    """A headless Chromium driver, or a test failure that says how to install it."""
    if not CHROMEDRIVER or not (shutil.which("chromium") or shutil.which("chromium-browser")):
        pytest.fail("chromium/chromedriver missing: run `bash scripts/setup.sh test` (installs them)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    for a in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--window-size=1400,1000"):
        opts.add_argument(a)
    opts.binary_location = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    driver.implicitly_wait(0)
    return driver


def wait_for(driver, css: str, timeout: float = 40, visible_text: str | None = None, root=None):
    """The first displayed element matching `css` (and containing `visible_text`), waiting for the UI to render."""
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            els = [e for e in (root or driver).find_elements(By.CSS_SELECTOR, css) if e.is_displayed()]
            if visible_text is not None:
                els = [e for e in els if visible_text in e.text]
        except StaleElementReferenceException:  # the UI re-rendered between finding and reading: look again
            els = []
        if els:
            return els[0]
        time.sleep(0.3)
    raise TimeoutError(f"{css!r} ({visible_text!r}) not shown on {driver.current_url}")


def log_in(driver, base_url: str, user: str, password: str) -> None:
    """Log in through the Simple auth manager's form; fails the test if the login page stays."""
    from selenium.webdriver.common.by import By

    driver.get(base_url + "/")
    wait_for(driver, "input[type=password]")
    driver.find_elements(By.CSS_SELECTOR, "input:not([type=password])")[0].send_keys(user)
    driver.find_element(By.CSS_SELECTOR, "input[type=password]").send_keys(password)
    driver.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
    deadline = time.monotonic() + 40
    while "/auth/" in driver.current_url and time.monotonic() < deadline:
        time.sleep(0.3)
    assert "/auth/" not in driver.current_url, "login did not leave the login page"
    assert driver.get_cookie("_token"), "no session cookie after login"
