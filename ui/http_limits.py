"""A ceiling on the size of every HTTP request body, applied before Gradio parses anything.

Gradio limits files sent to its upload route, but an image can also arrive inside the JSON of an API
call, as a data URL, and that body is read whole into memory. This ASGI middleware answers 413 to any
body over the limit: by its Content-Length at once, or, for a body sent in chunks, as soon as the bytes
read pass the limit (such a body is read here and handed on whole). The upload route has a limit of its own,
room for a video or a selection of images (Gradio streams those to disk).
"""
from __future__ import annotations

import json
import logging
import math

from prefixkv_core.limits import MB

log = logging.getLogger(__name__)


UPLOAD_IMAGES_AT_ONCE = 16  # images one upload request may carry at the image limit (a gallery's selection)


def body_limit_for(max_image_bytes: int) -> int:
    """Room for one image as base64 text (4/3 of its bytes) and the rest of a request."""
    return int(math.ceil(max_image_bytes * 4 / 3)) + 1 * MB


def upload_limit_for(max_image_bytes: int, max_video_bytes: int) -> int:
    """The upload route's bodies: a video, or UPLOAD_IMAGES_AT_ONCE images chosen together, and the multipart
    framing. Gradio streams them to its upload folder (never whole into memory) and holds each file to its own
    limit."""
    return max(int(max_video_bytes), UPLOAD_IMAGES_AT_ONCE * int(max_image_bytes)) + 1 * MB


def _is_upload(scope) -> bool:
    return scope.get("method") == "POST" and str(scope.get("path", "")).rstrip("/").endswith("/upload")


def _counted(receive, limit: int):
    """`receive` that ends the request as if the client left once more than `limit` bytes arrived."""
    seen = 0

    async def counted():
        nonlocal seen
        message = await receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > limit:
                log.info("refused: an upload over %.1f MB, sent in chunks", limit / MB)
                return {"type": "http.disconnect"}
        return message

    return counted


class BodySizeLimit:
    """`max_bytes` for every body; `upload_max_bytes` (default the same) for Gradio's upload route."""

    def __init__(self, app, max_bytes: int, upload_max_bytes: int | None = None):
        self.app = app
        self.max_bytes = int(max_bytes)
        self.upload_max_bytes = int(upload_max_bytes) if upload_max_bytes is not None else self.max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.upload_max_bytes if _is_upload(scope) else self.max_bytes
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None:  # the server holds the client to the length it declared
            try:
                size = int(declared)
            except ValueError:
                size = limit + 1
            if size > limit:
                await self._refuse(send, size, limit)
                return
            await self.app(scope, receive, send)
            return
        if scope.get("method") in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        if _is_upload(scope):  # an upload in chunks: streamed on (Gradio writes it to disk), cut off past its limit
            await self.app(scope, _counted(receive, limit), send)
            return
        # Chunked: read it here, at most the limit, and hand it on whole.
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away
            body = message.get("body", b"")
            size += len(body)
            if size > limit:
                await self._refuse(send, size, limit)
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

    async def _refuse(self, send, size: int, limit: int) -> None:
        log.info("refused: a request body of %.1f MB (limit %.1f MB)", size / MB, limit / MB)
        body = json.dumps({"detail": f"request body over {limit / MB:.1f} MB"}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
