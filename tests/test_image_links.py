"""Issue 53, items 7 and 8 (What to build 5): image links and image counts. A host dripping one byte every two seconds
held a request for as long as it liked (the bound was per read); links to 127.0.0.1, [::1], 0.0.0.0 and
169.254.169.254 were fetched, and the error messages told a refused connection from a 404 (a port scanner); a
redirect to ftp:// was followed before it was checked. Forty 1-bit 4096x4096 PNGs in one request were all decoded,
even for a model without a vision encoder. Here a local HTTP server plays the hostile host."""

from __future__ import annotations

import base64
import io
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from deltaserve.vision import fetch as F
from deltaserve.vision.inputs import ImageInputError, ImageLimits, fetch_url, take_images


def png(width: int, height: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("1", (width, height)).save(buf, "PNG")
    return buf.getvalue()


class Host:
    """A local HTTP server: /img answers a small PNG, /drip a byte at a time, /redirect?to=URL a 302, /missing a 404."""

    def __init__(self):
        self.seen: list[str] = []
        self.drip_sent = 0
        self.drip_closed = threading.Event()
        host = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                host.seen.append(self.path)
                if self.path == "/img":
                    body = png(4, 4)
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                elif self.path == "/drip":
                    self.send_response(200)
                    self.send_header("Content-Length", "1000")
                    self.end_headers()
                    try:
                        for _ in range(1000):
                            self.wfile.write(b"x")
                            self.wfile.flush()
                            host.drip_sent += 1
                            time.sleep(0.2)
                    except OSError:
                        pass
                    host.drip_closed.set()
                elif self.path.startswith("/redirect?to="):
                    self.send_response(302)
                    self.send_header("Location", self.path.split("=", 1)[1])
                    self.end_headers()
                else:
                    self.send_response(404)
                    self.end_headers()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()


@pytest.fixture(scope="module")
def host():
    h = Host()
    yield h
    h.close()


def failure(url: str, **kwargs) -> F.FetchFailed:
    with pytest.raises(F.FetchFailed) as e:
        F.fetch_image(url, 1 << 20, **kwargs)
    return e.value


@pytest.mark.parametrize("address", ["127.0.0.1", "::1", "0.0.0.0", "169.254.169.254", "10.0.0.1", "192.168.1.1",
                                     "::ffff:127.0.0.1", "224.0.0.1", "100.64.0.1"])
def test_loopback_private_link_local_and_unspecified_addresses_are_not_public(address):
    assert not F.public(address)


def test_a_public_address_is():
    assert F.public("93.184.216.34") and F.public("2606:2800:220:1:248:1893:25c8:1946")


def test_a_link_to_this_host_is_refused_unless_private_links_are_allowed(host):
    err = failure(host.url + "/img")
    assert "not public" in err.detail and not host.seen  # refused before any connection
    assert F.fetch_image(host.url + "/img", 1 << 20, allow_private=True).startswith(b"\x89PNG")


def test_every_failure_reads_the_same_to_the_client(host):
    """A refused port, a 404, a private address and a bad scheme: one message (no oracle for a port scan)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    messages = {str(failure(f"http://127.0.0.1:{closed}/x", allow_private=True)),
                str(failure(host.url + "/missing", allow_private=True)),
                str(failure(host.url + "/img")),
                str(failure("ftp://127.0.0.1/x"))}
    assert messages == {F.FETCH_FAILED}
    with pytest.raises(ImageInputError) as e:
        fetch_url(host.url + "/missing", allow_private=True)
    assert str(e.value) == F.FETCH_FAILED


def test_a_dripping_host_is_cut_off_at_the_deadline_of_the_whole_fetch(host):
    err = failure(host.url + "/drip", deadline_s=1.0, allow_private=True)
    assert "deadline" in err.detail or "timed out" in err.detail, err.detail
    assert host.drip_closed.wait(30)  # the connection was closed: the host's writes failed
    assert host.drip_sent < 1000  # it did not get to send the whole body


def test_a_redirect_is_checked_before_it_is_followed(host):
    with socket.socket() as listener:  # an "ftp" port: it must never see a connection
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        listener.settimeout(0.5)
        target = f"ftp://127.0.0.1:{listener.getsockname()[1]}/x"
        err = failure(f"{host.url}/redirect?to={target}", allow_private=True)
        assert "not an http(s) link" in err.detail
        with pytest.raises(socket.timeout):
            listener.accept()
    host.seen.clear()
    err = failure(f"{host.url}/redirect?to=http://169.254.169.254/latest/meta-data", allow_private=False)
    assert not host.seen  # the first hop was already private: never connected
    assert F.fetch_image(f"{host.url}/redirect?to={host.url}/img", 1 << 20, allow_private=True).startswith(b"\x89PNG")


# -- counts and pixels -----------------------------------------------------------------------------------------------
def image_message(n: int, size: int = 4096) -> list[dict]:
    url = "data:image/png;base64," + base64.b64encode(png(size, size)).decode()
    return [{"role": "user", "content": [{"type": "text", "text": "look"}] +
             [{"type": "image_url", "image_url": {"url": url}} for _ in range(n)]}]


def test_images_over_the_count_are_refused_before_any_is_read():
    with pytest.raises(ImageInputError, match="holds 9 images, more than this server's limit of 8") as e:
        take_images(image_message(9, 4), limits=ImageLimits(max_images=8))
    assert e.value.where == "messages[0].content[9]"


def test_the_pixels_of_all_images_together_are_bounded_from_their_headers_before_any_decode(monkeypatch):
    from deltaserve.vision import inputs

    decoded = []
    monkeypatch.setattr(inputs, "_decoded", lambda raw, max_pixels: decoded.append(1))
    limits = ImageLimits(max_pixels=4096 * 4096, max_images=40, max_total_pixels=2 * 4096 * 4096)
    with pytest.raises(ImageInputError, match="declare 50331648 pixels together, over this server's limit"):
        take_images(image_message(3), limits=limits)
    assert decoded == []  # refused from the headers: nothing was decoded
    take_images(image_message(2), limits=limits)
    assert len(decoded) == 2


def test_a_model_without_a_vision_encoder_refuses_image_parts_unread():
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:not even base64"}}]}]
    with pytest.raises(ImageInputError, match="no vision encoder"):
        take_images(messages, limits=ImageLimits(vision=False))
