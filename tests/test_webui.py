"""The chat page at / of `deltaserve serve`, driven in headless Chromium (Debian's `chromium` and `chromium-driver`,
through selenium) against real servers: the embedded demo model behind an API key, and the vision fixture with the
real Qwen3.5 vocabulary (it writes until its budget ends, so a stop lands midway). A screenshot of each state goes to
the test's tmp dir. Without a browser the browser tests are skipped, saying why."""

from __future__ import annotations

import base64
import io
import json
import re
import shutil
import sys
import time
from pathlib import Path

import httpx
import pytest

from deltaserve.demo import DEMO_FILE
from tests.fixtures import models as fx
from tests.server_proc import ServerProcess

KEY = "page-test-key"
BROWSER, DRIVER = shutil.which("chromium") or shutil.which("chromium-browser"), shutil.which("chromedriver")
FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--window-size=1200,900")


def _why_no_browser() -> str | None:
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install -e '.[test]')"
    if not BROWSER or not DRIVER:
        return ("no headless browser here: the chat page's tests need Debian's chromium and chromium-driver "
                "(apt-get install -y chromium chromium-driver)")
    return None


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    why = _why_no_browser()
    if why:
        pytest.skip(why)  # the reason is printed in the run's summary (-ra)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = BROWSER
    for flag in FLAGS + (f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}",):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(DRIVER))
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def demo_server():
    """The demo model behind an API key, one slot: a second conversation takes the slot, the first one's state waits
    in the store."""
    with ServerProcess(DEMO_FILE, "--slots", "1", "--api-key", KEY) as server:
        yield server


@pytest.fixture(scope="module")
def vision_server():
    with ServerProcess(fx.hf_dir("vision_real_vocab"), "--slots", "1") as server:
        yield server


class Page:
    def __init__(self, driver, url: str, shots: Path):
        from selenium.webdriver.common.by import By

        self.d, self.url, self.shots, self.By = driver, url, shots, By
        shots.mkdir(parents=True, exist_ok=True)

    def open(self, fresh: bool = True, key: str | None = KEY) -> "Page":
        self.d.get(self.url + "/")
        if fresh:
            self.d.execute_script("localStorage.clear()")
            if key:
                self.d.execute_script(f"localStorage.setItem('deltaserve.apiKey', {json.dumps(key)})")
            self.d.get(self.url + "/")
        self.wait(lambda: self.body("ready") == "yes", "the page to list the server's model")
        return self

    def body(self, name: str) -> str | None:
        return self.d.find_element(self.By.TAG_NAME, "body").get_attribute(f"data-{name}")

    def css(self, selector: str):
        return self.d.find_elements(self.By.CSS_SELECTOR, selector)

    def wait(self, ok, what: str, timeout: float = 60.0, every: float = 0.05):
        deadline = time.time() + timeout
        while time.time() < deadline:
            got = ok()
            if got:
                return got
            time.sleep(every)
        self.d.save_screenshot(str(self.shots / "timed-out.png"))
        shown = self.d.execute_script("return document.getElementById('main').innerText")
        raise AssertionError(f"timed out waiting for {what} (the page, in {self.shots / 'timed-out.png'}):\n"
                             f"{shown[-2000:]}")

    def setting(self, element_id: str, value: str) -> None:
        details = self.d.find_element(self.By.ID, "settings")
        if not details.get_attribute("open"):
            details.find_element(self.By.TAG_NAME, "summary").click()
        field = self.d.find_element(self.By.ID, element_id)
        if field.tag_name == "select":
            from selenium.webdriver.support.ui import Select

            Select(field).select_by_value(value)
        else:
            field.clear()
            field.send_keys(value)
        details.find_element(self.By.TAG_NAME, "summary").click()  # folded again

    def type(self, text: str) -> None:
        box = self.d.find_element(self.By.ID, "input")
        box.send_keys(text)
        self.d.find_element(self.By.ID, "send").click()

    def say(self, text: str) -> dict:
        """Send a message and wait for the whole answer: its text and its stats."""
        before = len(self.css(".msg.assistant"))
        self.type(text)
        self.wait(lambda: len(self.css(".msg.assistant")) > before and self.body("streaming") == "no", "the answer")
        return self.last()

    def last(self) -> dict:
        m = self.css(".msg.assistant")[-1]
        stats = m.find_element(self.By.CSS_SELECTOR, ".stats")
        got = {k: stats.get_attribute(f"data-{k}") for k in ("prompt-tokens", "cached-tokens", "completion-tokens",
                                                            "ttft-ms", "tok-s")}
        return {"text": m.find_element(self.By.CSS_SELECTOR, ".content").text,
                **{k.replace("-", "_"): (float(v) if v is not None else None) for k, v in got.items()}}

    def shot(self, name: str) -> Path:
        path = self.shots / f"{name}.png"
        self.d.save_screenshot(str(path))
        assert path.stat().st_size > 1000
        return path

    def conversations(self):
        return self.css("#conversations li")


def health(server) -> dict:
    return httpx.get(server.url + "/health", headers={"Authorization": f"Bearer {KEY}"}, timeout=10).json()


def png(seed: int, w: int = 150, h: int = 90) -> bytes:
    from tests.test_vision import _picture

    out = io.BytesIO()
    _picture(w, h, seed).save(out, format="PNG")
    return out.getvalue()


def test_three_streamed_turns_a_second_conversation_and_back_to_the_first_without_prefilling_it(
        browser, demo_server, tmp_path):
    page = Page(browser, demo_server.url, tmp_path).open()
    turns = [page.say(t) for t in ("My locker code is 4821.", "What is 12 + 9?", "Reverse these words: red fox blue")]
    assert "21" in turns[1]["text"] and all(t["text"] and t["completion_tokens"] > 0 for t in turns)
    assert all(t["ttft_ms"] > 0 for t in turns) and turns[2]["cached_tokens"] > 0
    page.shot("1-three-turns")
    page.d.find_element(page.By.ID, "new-chat").click()
    other = page.say("My name is Ada.")
    assert other["cached_tokens"] == 0 and len(page.conversations()) == 2
    page.shot("2-second-conversation")
    restores = health(demo_server)["store"]["restores"]["ram"]
    log_from = len(demo_server.stderr)
    page.conversations()[1].click()  # the first conversation, listed below the newer one
    page.wait(lambda: len(page.css(".msg.assistant")) == 3, "the first conversation's messages")
    back = page.say("What is my locker code?")
    page.shot("3-back-to-the-first")
    assert "4821" in back["text"]
    # the slot held the second conversation: the first one's state came back from the store, and the turn reused as
    # much as a turn that never left does (all but the previous request's generation header; the answer after it is
    # re-rendered, as in every turn)
    assert health(demo_server)["store"]["restores"]["ram"] == restores + 1
    header = turns[1]["prompt_tokens"] - turns[2]["cached_tokens"]
    assert back["cached_tokens"] == turns[2]["prompt_tokens"] - header > 0
    starts = [int(re.search(r"from position (\d+)", line)[1])
              for line in demo_server.stderr[log_from:].splitlines() if "batched prefill" in line]
    assert starts and min(starts) == back["cached_tokens"], starts  # nothing before it prefilled again
    # the conversations are the browser's: a reload lists both again
    page.open(fresh=False)
    assert [li.text.split("\n")[0] for li in page.conversations()] == ["My name is Ada.", "My locker code is 4821."]


def test_the_page_asks_for_the_api_key_when_the_server_answers_401(browser, demo_server, tmp_path):
    page = Page(browser, demo_server.url, tmp_path)
    page.d.get(demo_server.url + "/")
    page.d.execute_script("localStorage.clear()")
    page.d.get(demo_server.url + "/")
    dialog = page.wait(lambda: [d for d in page.css("#key-dialog") if d.get_attribute("open") is not None], "the ask")
    page.shot("4-api-key-asked")
    page.d.find_element(page.By.ID, "key-input").send_keys("wrong-key")
    page.d.find_element(page.By.ID, "key-save").click()
    page.wait(lambda: "refused this API key" in dialog[0].text, "the ask again, saying the key was refused")
    page.d.find_element(page.By.ID, "key-input").send_keys(KEY)
    page.d.find_element(page.By.ID, "key-save").click()
    page.wait(lambda: page.body("ready") == "yes", "the model listed with the key")
    assert page.d.find_element(page.By.ID, "model-name").text == "demo-qwen35.gguf"
    assert page.d.execute_script("return localStorage.getItem('deltaserve.apiKey')") == KEY


def test_a_tool_call_is_shown_and_its_result_goes_back_to_the_model(browser, demo_server, tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "demo"))
    import corpus

    page = Page(browser, demo_server.url, tmp_path).open()
    page.setting("set-tools", json.dumps([corpus.WEATHER_TOOL]))
    page.say("What's the weather in Paris?")
    (call,) = page.css(".msg.assistant .tool-call")
    assert call.get_attribute("data-name") == "get_weather" and json.loads(call.find_element(
        page.By.TAG_NAME, "code").text) == {"city": "Paris"}
    page.shot("5-tool-call")
    result = corpus.weather_result("Paris", 13, "foggy")  # what the demo model was taught a tool returns
    page.d.find_element(page.By.CSS_SELECTOR, ".tool-result input").send_keys(result)
    before = len(page.css(".msg.assistant"))
    page.d.find_element(page.By.CSS_SELECTOR, ".tool-result button").click()
    page.wait(lambda: len(page.css(".msg.assistant")) > before and page.body("streaming") == "no", "the answer")
    assert "foggy" in page.last()["text"].lower() and "13" in page.last()["text"]
    assert page.css(".msg.tool")[0].text.endswith(result)


def test_an_image_dropped_on_a_text_only_model_is_refused_on_the_page(browser, demo_server, tmp_path):
    page = Page(browser, demo_server.url, tmp_path).open()
    assert page.body("vision") == "no"
    drop(page, png(1))
    page.wait(lambda: "no vision encoder" in page.d.find_element(page.By.ID, "notice").text, "the notice")
    assert page.body("attachments") in (None, "0")


def drop(page: Page, data: bytes, paste: bool = False) -> None:
    """A PNG dropped on the page (or pasted into the message box) as a browser hands a file to it."""
    page.d.execute_script("""
        const bytes = Uint8Array.from(atob(arguments[0]), c => c.charCodeAt(0));
        const dt = new DataTransfer();
        dt.items.add(new File([bytes], "picture.png", {type: "image/png"}));
        if (arguments[1]) {
            document.getElementById("input").dispatchEvent(
                new ClipboardEvent("paste", {clipboardData: dt, bubbles: true, cancelable: true}));
        } else {
            const main = document.getElementById("main");
            main.dispatchEvent(new DragEvent("dragover", {dataTransfer: dt, bubbles: true, cancelable: true}));
            main.dispatchEvent(new DragEvent("drop", {dataTransfer: dt, bubbles: true, cancelable: true}));
        }""", base64.b64encode(data).decode(), paste)


def test_images_dropped_and_pasted_go_with_the_question_to_a_vision_model(browser, vision_server, tmp_path):
    import deltaserve
    from PIL import Image

    page = Page(browser, vision_server.url, tmp_path).open(key=None)
    assert page.body("vision") == "yes"
    page.setting("set-max-tokens", "4")
    page.setting("set-think", "off")
    text_only = page.say("What is in this picture?")
    page.d.find_element(page.By.ID, "new-chat").click()
    drop(page, png(2))
    drop(page, png(3, 70, 200), paste=True)
    page.wait(lambda: page.body("attachments") == "2", "two attachments")
    page.shot("6-images-attached")
    with_images = page.say("What is in this picture?")
    assert len(page.css(".msg.user .images img")) == 2
    page.shot("7-image-turn")
    vision = deltaserve.load(fx.hf_dir("vision_real_vocab")).host.vision
    # each image is its placeholder tokens between a vision start and end token, before the question
    expected = sum(vision.tokens(Image.open(io.BytesIO(png(*a)))) + 2 for a in ((2,), (3, 70, 200)))
    assert with_images["prompt_tokens"] - text_only["prompt_tokens"] == expected


def test_thinking_is_folded_and_opens_on_a_click(browser, vision_server, tmp_path):
    page = Page(browser, vision_server.url, tmp_path).open(key=None)
    page.setting("set-think", "on")
    page.setting("set-max-tokens", "24")
    page.say("Think about a number.")
    think = page.css(".msg.assistant .thinking")[-1]
    reasoning = think.find_element(page.By.CSS_SELECTOR, ".reasoning")
    assert think.get_attribute("open") is None and not reasoning.is_displayed()
    assert page.d.execute_script("return arguments[0].textContent.length", reasoning) > 0
    page.shot("8-thinking-folded")
    think.find_element(page.By.TAG_NAME, "summary").click()
    assert think.get_attribute("open") is not None and reasoning.is_displayed() and reasoning.text
    page.shot("9-thinking-open")


def test_stop_ends_an_answer_midway_keeps_what_came_and_regenerate_answers_again(browser, vision_server, tmp_path):
    page = Page(browser, vision_server.url, tmp_path).open(key=None)
    page.setting("set-think", "off")
    page.setting("set-max-tokens", "4000")  # ~20 s of this model's tokens: the stop lands well before the end
    page.type("Tell me a very long story.")
    # read in the page: the streaming message's element is replaced as each piece comes
    page.wait(lambda: page.d.execute_script("const c = document.querySelectorAll('.msg.assistant .content'); "
                                            "return document.body.dataset.streaming === 'yes' && c.length > 0 && "
                                            "c[c.length - 1].textContent.length > 20"), "the answer to start streaming")
    page.d.find_element(page.By.ID, "stop").click()
    page.wait(lambda: page.body("streaming") == "no", "the stop")
    answer = page.css(".msg.assistant")[-1]
    assert answer.find_elements(page.By.CSS_SELECTOR, ".stats .stopped") and answer.find_element(
        page.By.CSS_SELECTOR, ".content").text
    page.shot("10-stopped")
    # the server ended the generation (its slot is free again) long before the budget
    page.wait(lambda: not health(vision_server)["slots"][0]["busy"], "the slot to be free", timeout=10)
    page.setting("set-max-tokens", "3")
    page.d.find_element(page.By.CSS_SELECTOR, ".msg.assistant .regenerate").click()
    page.wait(lambda: page.body("streaming") == "no" and page.last()["completion_tokens"] == 3, "the new answer")
    assert len(page.css(".msg.assistant")) == 1 and not page.css(".stats .stopped")
    page.shot("11-regenerated")


def test_the_page_loads_nothing_from_another_origin(browser, vision_server, tmp_path):
    page = Page(browser, vision_server.url, tmp_path).open(key=None)
    loaded = page.d.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
    assert loaded and all(u.startswith(vision_server.url + "/") or u.startswith("data:") for u in loaded), loaded
    r = httpx.get(vision_server.url + "/")
    assert r.headers["content-security-policy"].startswith("default-src 'none'; script-src 'self'")


def test_the_page_answers_at_the_root_unless_no_webui_and_keeps_the_host_check():
    """In process (no browser): GET / and its two files with their content types and policy; a Host name the server
    does not answer to is refused there as on every route; --no-webui leaves / a 404 as before."""
    import deltaserve
    from fastapi.testclient import TestClient

    from deltaserve.frontends.cli import build_parser
    from deltaserve.frontends.server.app import Server, create_app

    server = Server(deltaserve.load(), slots=1, quiet=True)
    page = TestClient(create_app(server), base_url="http://127.0.0.1")
    got = {path: page.get(path) for path in ("/", "/webui/app.js", "/webui/app.css")}
    assert [(r.status_code, r.headers["content-type"].split(";")[0]) for r in got.values()] == \
        [(200, "text/html"), (200, "text/javascript"), (200, "text/css")]
    assert all(r.headers["x-content-type-options"] == "nosniff" and "frame-ancestors 'none'" in
               r.headers["content-security-policy"] for r in got.values())
    assert '<script src="/webui/app.js">' in got["/"].text and "http" not in got["/"].text.split("<body>")[1]
    assert page.get("/", headers={"Host": "rebound.example"}).status_code == 403
    assert page.get("/v1/models").json()["data"][0]["vision"] is False
    bare = TestClient(create_app(server, webui=False), base_url="http://127.0.0.1")
    assert bare.get("/").status_code == 404 and bare.get("/webui/app.js").status_code == 404
    assert build_parser().parse_args(["serve", "--no-webui"]).webui is False
    assert build_parser().parse_args(["serve"]).webui is True
