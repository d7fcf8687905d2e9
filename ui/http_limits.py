"""A ceiling on the size of every HTTP request body, applied before Gradio parses anything.

Gradio limits files sent to its upload route, but an image can also arrive inside the JSON of an API
call, as a data URL, and that body is read whole into memory. This ASGI middleware answers 413 to any
body over the limit: by its Content-Length at once, or, for a body sent in chunks, as soon as the bytes
read pass the limit (such a body is read here and handed on whole).
"""
from __future__ import annotations

import json
import logging
import math

from prefixkv_core.limits import MB

log = logging.getLogger(__name__)


def body_limit_for(max_image_bytes: int) -> int:
    """Room for one image as base64 text (4/3 of its bytes) and the rest of a request."""
    return int(math.ceil(max_image_bytes * 4 / 3)) + 1 * MB


class BodySizeLimit:
    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = int(max_bytes)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None:  # the server holds the client to the length it declared
            try:
                size = int(declared)
            except ValueError:
                size = self.max_bytes + 1
            if size > self.max_bytes:
                await self._refuse(send, size)
                return
            await self.app(scope, receive, send)
            return
        if scope.get("method") in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        # Chunked: read it here, at most max_bytes, and hand it on whole.
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_bytes:
                await self._refuse(send, size)
                return
            chunks.append(body)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, send, size: int) -> None:
        log.info("refused: a request body of %.1f MB (limit %.1f MB)", size / MB, self.max_bytes / MB)
        body = json.dumps({"detail": f"request body over {self.max_bytes / MB:.1f} MB"}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
