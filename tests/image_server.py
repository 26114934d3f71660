"""An HTTP image server on a loopback address, for the remote image tests (pytest puts tests/ on the
path): /img.png, /redirect?LOCATION, /loop (redirects to itself), /big and /big-chunked (over
MAX bytes), /drip (the image a few bytes at a time, over seconds). `seen` lists (path, Host)."""

from __future__ import annotations

import http.server
import threading
import time
from contextlib import contextmanager

from vlm_images import image_bytes

PNG = image_bytes(3)
MAX = 4 * len(PNG)  # the tests' vision.max_image_bytes


class _Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        srv = self.server
        srv.seen.append((self.path, self.headers.get("Host")))  # type: ignore[attr-defined]
        path, _, query = self.path.partition("?")
        if path == "/img.png":
            self._send(200, PNG)
        elif path == "/redirect":
            self.send_response(302)
            self.send_header("Location", query)
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif path == "/loop":
            self.send_response(301)
            self.send_header("Location", "/loop")
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif path == "/big":
            self._send(200, PNG + b"\0" * MAX)
        elif path == "/big-chunked":
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for _ in range(MAX // 1024 + 1):
                self.wfile.write(b"400\r\n" + b"\0" * 1024 + b"\r\n")
            self.wfile.write(b"0\r\n\r\n")
        elif path == "/drip":  # a whole image, a few bytes at a time, over seconds
            self.send_response(200)
            self.send_header("Content-Length", str(len(PNG)))
            self.end_headers()
            step = max(1, len(PNG) // 40)
            for i in range(0, len(PNG), step):
                self.wfile.write(PNG[i : i + step])
                self.wfile.flush()
                time.sleep(0.15)
        else:
            self._send(404, b"no")

    def _send(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@contextmanager
def image_server(host: str):
    srv = http.server.ThreadingHTTPServer((host, 0), _Handler)
    srv.daemon_threads = True
    srv.seen = []  # type: ignore[attr-defined]
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield srv, f"http://{host}:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()
