"""The web page end to end in headless Chromium (Debian's ``chromium`` and
``chromium-driver``, installed here with apt-get when missing), driven by Selenium: a
prompt in, the streamed text, previews, the final image and the live stage table out."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

pytest.importorskip(
    "diffusers", reason="needs the DiT family (omni-dit-stages); runs in the workspace"
)
webdriver = pytest.importorskip("selenium.webdriver")
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

PACKAGES = ["chromium", "chromium-driver"]
# the first use may apt-get install the browser (minutes on a fresh machine)
pytestmark = pytest.mark.timeout(1500)


def _paths() -> tuple[str, str] | None:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    return (browser, driver) if browser and driver else None


def _install() -> str:
    """apt-get install the packages; '' on success, else why not."""
    if not shutil.which("apt-get"):
        return "apt-get is not available"
    if os.geteuid() != 0:
        return "not root: cannot apt-get install"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES]
    r = subprocess.run(install, capture_output=True, text=True, env=env, timeout=900)
    if r.returncode != 0:  # a fresh machine may have no package lists yet
        subprocess.run(["apt-get", "update", "-q"], capture_output=True, env=env, timeout=600)
        r = subprocess.run(install, capture_output=True, text=True, env=env, timeout=900)
    return "" if r.returncode == 0 else f"apt-get install failed: {r.stderr[-800:]}"


@pytest.fixture(scope="session")
def chromium() -> tuple[str, str]:
    paths = _paths()
    why = ""
    if paths is None:
        why = _install()
        paths = _paths()
    if paths is None:
        msg = f"the browser test needs {' and '.join(PACKAGES)} (Debian): {why or 'not found'}"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    return paths


@pytest.fixture
def browser(chromium):
    binary, driver = chromium
    opts = webdriver.ChromeOptions()
    opts.binary_location = binary
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        opts.add_argument(arg)
    opts.add_argument("--window-size=1100,1000")
    drv = webdriver.Chrome(options=opts, service=Service(executable_path=driver))
    yield drv
    drv.quit()


def test_page_streams_text_previews_and_the_final_image(image_server, browser, tmp_path):
    browser.get(f"{image_server.url}/")
    state = lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-state")  # noqa: E731
    WebDriverWait(browser, 30).until(lambda d: state(d) == "idle")
    prompt = browser.find_element(By.ID, "prompt")
    prompt.clear()
    prompt.send_keys("a lighthouse at dusk")
    browser.find_element(By.ID, "send").click()
    WebDriverWait(browser, 180).until(lambda d: state(d) in ("done", "error"))
    status = browser.find_element(By.ID, "status").text
    assert state(browser) == "done", status
    assert browser.find_element(By.ID, "text").text  # the streamed expanded prompt
    final = browser.find_element(By.ID, "final")
    assert final.get_attribute("src").startswith("data:image/jpeg;base64,")
    assert browser.execute_script("return arguments[0].naturalWidth", final) == 64
    preview = browser.find_element(By.ID, "preview")
    assert preview.get_attribute("src").startswith("data:image/png;base64,")
    assert browser.find_element(By.ID, "preview-cap").text.startswith("preview ")

    def encode_completed(d) -> bool:  # the live stage table (refreshed every second)
        rows = d.execute_script(
            "return [...document.querySelectorAll('#stages tbody tr')]"
            ".map(r => [...r.cells].map(c => c.textContent))"
        )
        cells = {r[0]: r for r in rows}
        return len(cells) == 9 and cells["encode"][1] == "ready" and int(cells["encode"][6]) >= 1

    WebDriverWait(browser, 10).until(encode_completed)
    shot = tmp_path / "page.png"
    assert browser.save_screenshot(str(shot))
    data = shot.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 10_000


def test_page_plays_the_audio_of_a_pipeline_that_speaks(browser, tmp_path):
    """On a speech pipeline the page asks for text and audio, shows the transcript as it
    streams and puts the audio chunks, as one WAV, in its ``<audio>`` element, which the
    browser decodes (a duration, at the model's 24 kHz)."""
    pytest.importorskip("omni_speech", reason="needs the speech family (omni-speech-stages)")
    from pathlib import Path

    from .conftest import start_server, stop_server

    config = Path(__file__).resolve().parents[3] / "configs" / "omni_speech.yaml"
    server = start_server(config, tmp_path)
    try:
        browser.get(f"{server.url}/")
        state = lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-state")  # noqa: E731
        WebDriverWait(browser, 30).until(lambda d: state(d) == "idle")
        audio = browser.find_element(By.ID, "audio")
        assert audio.is_displayed() and not browser.find_element(By.ID, "images").is_displayed()
        browser.find_element(By.ID, "send").click()
        WebDriverWait(browser, 120).until(lambda d: state(d) in ("done", "error"))
        assert state(browser) == "done", browser.find_element(By.ID, "status").text
        assert browser.find_element(By.ID, "text").text  # the transcript
        assert audio.get_attribute("src").startswith("blob:")
        duration = "return arguments[0].readyState >= 1 ? arguments[0].duration : null"
        WebDriverWait(browser, 10).until(lambda d: d.execute_script(duration, audio))
        seconds = browser.execute_script(duration, audio)
        # as long as its samples: 16-bit mono at 24 kHz after the 44-byte header
        size = int(audio.get_attribute("data-bytes"))
        assert abs(seconds - (size - 44) / 2 / 24000) < 1e-3, (seconds, size)
    finally:
        stop_server(server)
