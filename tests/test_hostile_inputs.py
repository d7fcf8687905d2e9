"""Every kind of input a hostile client can send, through the real server on a loopback port: for each one the
visitor's message, a normal request right after (each test's end) that answers as it did before, and no file
opened outside the upload folder and the shipped examples (every `open` the server's process makes is watched with an audit hook).

The files are made here and are small: limits are set low so that a few kilobytes pass them (LIMITS). Each kind is
a row of docs/security.md's "Every input kind" table with the words of its message (`KINDS`, checked at the end).
"""
from __future__ import annotations

import base64
import contextlib
import io
import json
import os
import sys
import threading
from fractions import Fraction
from pathlib import Path
from types import SimpleNamespace

import av
import httpx
import numpy as np
import pytest
from PIL import Image

from prefixkv_core import Engine
from prefixkv_core.limits import IMAGE_REFUSED, Limits
from prefixkv_core.session.video_input import VIDEO_REFUSED, write_video

ROOT = Path(__file__).resolve().parent.parent
CLIP = ROOT / "assets" / "videos" / "clip-0.mp4"  # 16 frames of 384 x 384
LIMITS = Limits(max_image_bytes=300_000, max_image_pixels=250_000, max_prompt_tokens=256, max_run_tokens=1024,
                max_sessions=3, idle_s=600, cache_limit_bytes=None, memory_limit_bytes=None, max_batch_users=1,
                max_video_bytes=400_000, max_video_pixels=2_500_000, max_frame_pixels=200_000,
                max_video_decode_pixels=5_000_000, max_video_decode_s=20.0)
MARK = {"_type": "gradio.FileData"}
IMAGE_NO = f"image: {IMAGE_REFUSED}"
IMAGES_NO = f"images: {IMAGE_REFUSED}"
VIDEO_NO = f"video: {VIDEO_REFUSED}"

# kind (a row of docs/security.md) -> words its message holds there and here, whatever the limits
KINDS = {
    "server path": IMAGE_REFUSED,
    "symlink in the upload folder": IMAGE_REFUSED,
    "FIFO in the upload folder": IMAGE_REFUSED,
    "URL": IMAGE_REFUSED,
    "URL or server path past the 64th gallery item": IMAGE_REFUSED,
    "data URL, malformed": IMAGE_REFUSED,
    "image over the byte limit": "MB; the limit is",
    "oversize upload": "File size exceeded maximum allowed size",
    "image over the pixel limit": "megapixels); the limit is",
    "decompression bomb": "megapixels); the limit is",
    "not an image": IMAGE_REFUSED,
    "polyglot file": "",
    "16-bit image": "",
    "CMYK JPEG": "",
    "EXIF rotation": "",
    "animated GIF": "",
    "too many images": "images; the limit is 64",
    "more images than the run's tokens": "of them fit",
    "corrupt video": VIDEO_REFUSED,
    "truncated video": VIDEO_REFUSED,
    "video without a video track": VIDEO_REFUSED,
    "video over the byte limit": "MB; the limit is",
    "video frames over the pixel limit, from the header": "megapixels; the limit is",
    "video frames larger than the header says": "(its header says",
    "long video, few keyframes": "its keyframes are far apart",
    "long video, one frame asked": "",
    "frame count out of range": "frames must be a whole number from 1 to 64",
}


# -- every file the process opens while an attack is answered ---------------------------------------------------

_OPENED: list[str] | None = None
_LOCK = threading.Lock()


def _audit(event, args):
    if event == "open" and _OPENED is not None and args and isinstance(args[0], (str, bytes, os.PathLike)):
        path = os.fsdecode(args[0])
        with _LOCK:
            if _OPENED is not None:
                _OPENED.append(path)


sys.addaudithook(_audit)  # hooks cannot be removed; this one records only while a test watches


def _may_open() -> list[str]:
    """Folders the server may read while it answers: the uploads, the examples, and its own code and runtime
    (lazy imports, /proc for its memory); nothing else."""
    from ui.inputs import upload_folder

    return [upload_folder(), str(ROOT / "assets"), sys.prefix, sys.base_prefix, str(ROOT / "prefixkv_core"),
            str(ROOT / "ui"), "/proc/", "/sys/fs/cgroup/", "/dev/null", "/dev/urandom"]


@contextlib.contextmanager
def watching():
    """The paths every thread of this process opens inside the block (a list, filled as they are opened)."""
    global _OPENED
    opened: list[str] = []
    with _LOCK:
        _OPENED = opened
    try:
        yield opened
    finally:
        with _LOCK:
            _OPENED = None


def _outside(paths: list[str]) -> list[str]:
    allowed = [os.path.realpath(p) for p in _may_open()]
    return [p for p in paths if not any(os.path.realpath(p) == a or os.path.realpath(p).startswith(a.rstrip("/") + "/")
                                        for a in allowed)]


# -- the server ---------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(tiny_llama, serve_app, api_client, tmp_path_factory):
    url = serve_app(Engine(tiny_llama), max_new_tokens_limit=16, limits=LIMITS)
    srv = SimpleNamespace(url=url, api=url + "gradio_api/", ctl=serve_app.demos[-1].controller,
                          private=tmp_path_factory.mktemp("server-private"))
    srv.params = httpx.get(srv.api + "info").json()["named_endpoints"]["/compare"]["parameters"]
    srv.normal = _answer(srv, image={"url": _data_url(_noise())})  # what a plain request answers; every attack must keep it
    return srv


def _noise(seed: int = 0, size=(64, 48)) -> Image.Image:
    rng = np.random.RandomState(seed)
    return Image.fromarray((rng.rand(size[1], size[0], 3) * 255).astype("uint8"))


def _inputs(server, **values):
    values = {"prompt": "Describe.", "methods": ["full"], "max_new_tokens": 4, **values}
    out = [values.pop(p["parameter_name"], p.get("parameter_default")) for p in server.params]
    assert not values, f"unknown inputs {values}"
    out.insert(9, None)  # the gr.State slot after seed
    return out


def _call(server, body: str):
    """POST a /call request and follow its event stream: ("complete", the results), ("error", message) or ("http",
    code). The results: the last value the stream gave the results output (a redraw that leaves it as it was sends
    none)."""
    r = httpx.post(server.api + "call/compare", content=body, timeout=60, headers={"content-type": "application/json"})
    if r.status_code != 200:
        return "http", r.status_code
    kind, results = None, None
    with httpx.stream("GET", server.api + f"call/compare/{r.json()['event_id']}", timeout=120) as stream:
        for line in stream.iter_lines():
            if line.startswith("event:"):
                kind = line[6:].strip()
            elif line.startswith("data:") and kind in ("generating", "complete", "error"):
                payload = json.loads(line[5:].strip())
                if kind == "error":
                    return kind, (payload or {}).get("error")
                found = [v for v in payload if isinstance(v, dict) and "finished" in v] if isinstance(payload, list) \
                    else []
                results = found[-1] if found else results
                if kind == "complete":
                    return kind, results
    return None, None


def _send(server, **values):
    return _call(server, json.dumps({"data": _inputs(server, **values)}))


def _answer(server, **values) -> dict:
    """The results of an accepted request (its methods' answers, prefill and visuals)."""
    kind, results = _send(server, **values)
    assert kind == "complete" and results is not None, results
    assert results["finished"], results
    return results


def _answer_of(results: dict) -> str:
    return results["methods"]["full"]["text"]


@pytest.fixture(autouse=True)
def a_normal_request_after(request):
    """After every test of a kind, a normal request answers exactly as it did before any attack."""
    yield
    if "server" in request.fixturenames:
        server = request.getfixturevalue("server")
        assert _answer_of(_answer(server, image={"url": _data_url(_noise())})) == _answer_of(server.normal)


def attack(server, expect: str | None, *, prefix: bool = False, **values) -> dict | None:
    """Sends one request as the attack; asserts the visitor's message (None: accepted, its results returned) and that
    nothing outside the allowed folders was opened meanwhile."""
    with watching() as opened:
        kind, data = _send(server, **values)
    assert not _outside(opened), _outside(opened)
    if expect is None:
        assert kind == "complete" and data is not None, data
        result = data
        assert result["finished"]
    else:
        assert kind == "error", (kind, str(data)[:300])
        assert (data.startswith(expect) if prefix else data == expect), data
        result = None
    return result


def _data_url(image: Image.Image, fmt: str = "PNG", **save) -> str:
    return "data:image/png;base64," + base64.b64encode(_bytes(image, fmt, **save)).decode()


def _bytes(image: Image.Image, fmt: str = "PNG", **save) -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt, **save)
    return buf.getvalue()


def _upload(server, name: str, data: bytes) -> dict:
    """A file sent through the upload route as a browser sends it; the file object naming it."""
    r = httpx.post(server.api + "upload", files={"files": (name, data)})
    assert r.status_code == 200, r.text
    return {"path": r.json()[0], "meta": MARK, "orig_name": name}


def _in_uploads(name: str) -> Path:
    from ui.inputs import upload_folder

    folder = Path(upload_folder()) / f"hostile-{os.getpid()}"
    folder.mkdir(parents=True, exist_ok=True)
    return folder / name


def test_the_watch_sees_a_file_another_thread_opens(server):
    """What `attack` relies on: a read of a server file by any thread (as a request handler would) is seen."""
    secret = server.private / "watched.txt"
    secret.write_text("private")
    with watching() as opened:
        reader = threading.Thread(target=secret.read_text)
        reader.start()
        reader.join()
    assert _outside(opened) == [str(secret)]


# -- server paths, links, FIFOs, URLs ---------------------------------------------------------------------------

def test_server_paths_are_refused_with_one_message_for_every_input(server):
    secret = server.private / "secret.png"
    Image.new("RGB", (32, 32), (255, 0, 255)).save(secret)
    for path in (str(secret), "/etc/passwd", "/dev/zero", str(server.private), "/nonexistent/x.png"):
        for payload in ({"path": path}, {"path": path, "meta": MARK}):
            attack(server, IMAGE_NO, image=payload)
            attack(server, IMAGES_NO, images=[{"image": payload}])
            attack(server, VIDEO_NO, video=payload)


def test_a_symlink_in_the_upload_folder_is_refused(server):
    secret = server.private / "linked.png"
    Image.new("RGB", (32, 32), (255, 0, 255)).save(secret)
    link = _in_uploads("link.png")
    link.unlink(missing_ok=True)
    link.symlink_to(secret)
    try:
        attack(server, IMAGE_NO, image={"path": str(link), "meta": MARK})
        attack(server, VIDEO_NO, video={"path": str(link), "meta": MARK})
    finally:
        link.unlink()


def test_a_fifo_in_the_upload_folder_is_refused_without_waiting_on_it(server):
    fifo = _in_uploads("pipe.png")
    fifo.unlink(missing_ok=True)
    os.mkfifo(fifo)
    try:
        attack(server, IMAGE_NO, image={"path": str(fifo), "meta": MARK})
        attack(server, IMAGES_NO, images=[{"image": {"path": str(fifo), "meta": MARK}}])
        attack(server, VIDEO_NO, video={"path": str(fifo), "meta": MARK})
    finally:
        fifo.unlink()


@pytest.fixture
def no_download(monkeypatch):
    """Gradio's downloader, replaced by one that records what it was asked to fetch (and fetches nothing)."""
    from gradio import processing_utils

    asked = []

    async def refuse_download(url, cache_dir):
        asked.append(url)
        raise ValueError("no downloads in this test")

    monkeypatch.setattr(processing_utils, "async_ssrf_protected_download", refuse_download)
    return asked


def test_urls_are_never_fetched_wherever_they_sit(server, no_download):
    for url in ("https://example.com/huge.png", "http://127.0.0.1:1/admin"):
        attack(server, IMAGE_NO, image={"path": url, "meta": MARK})
        attack(server, VIDEO_NO, video={"path": url, "meta": MARK})
        attack(server, IMAGES_NO, images=[{"image": {"path": url, "meta": MARK}}])
    assert no_download == []


def test_a_url_or_server_path_past_the_64th_gallery_item_is_refused_for_the_gallery(server, no_download):
    small = {"image": {"url": _data_url(Image.new("RGB", (8, 8), (9, 9, 9)))}}
    for bad in ({"path": "https://example.com/65th.png", "meta": MARK}, {"path": "/etc/passwd", "meta": MARK}):
        attack(server, IMAGES_NO, images=[small] * 64 + [{"image": bad}])
        attack(server, IMAGES_NO, images=[small] * 100 + [{"image": bad}])
    # without Gradio's marker Gradio never reads a path: the list is refused for its length, before any item is read
    attack(server, "images: 65 images; the limit is 64", images=[small] * 64 + [{"image": {"path": "/etc/passwd"}}])
    attack(server, IMAGES_NO, images=[[[[{"image": {"path": "https://example.com/deep.png", "meta": MARK}}]]]])
    assert no_download == []


# -- images -----------------------------------------------------------------------------------------------------

def test_data_urls_malformed_are_refused_and_well_formed_accepted(server):
    for bad in ("data:image/png;base64,!!!notbase64", "data:text/plain,hello", "data:image/png;base64,aGVsbG8=",
                "data:image/png;base64,"):
        attack(server, IMAGE_NO, image={"url": bad})
    results = attack(server, None, image={"url": _data_url(_noise(3))})
    assert results["visuals"]["images"] == [[64, 48]]


def test_images_over_the_byte_and_pixel_limits(server):
    big = _bytes(_noise(1, (350, 350)))  # about 370 kB as PNG: over the 300 kB limit, within the upload route's
    expected = f"image: the image is {len(big) / 2**20:.1f} MB; the limit is 0.286102 MB"
    attack(server, expected, image={"url": "data:image/png;base64," + base64.b64encode(big).decode()})
    attack(server, expected, image=_upload(server, "big.png", big))
    flat = Image.new("RGB", (600, 600), (10, 20, 30))  # a tiny file of 0.36 megapixels
    attack(server, "image: the image is 600×600 pixels (0.4 megapixels); the limit is 0.25 megapixels",
           image={"url": _data_url(flat)})
    attack(server, "images: image 2 of 2: the image is 600×600 pixels (0.4 megapixels); the limit is 0.25 "
                   "megapixels", images=[{"image": {"url": _data_url(_noise())}}, {"image": {"url": _data_url(flat)}}])


def test_an_oversize_upload_is_refused_by_the_upload_route(server):
    r = httpx.post(server.api + "upload", files={"files": ("big.mp4", b"\0" * 500_000, "video/mp4")})
    assert r.status_code == 413 and "File size exceeded maximum allowed size" in r.text


def test_a_decompression_bomb_gets_the_pixel_limit_message(server):
    bomb = _bytes(Image.new("1", (30000, 30000)))  # 900 megapixels in about 110 kB; Pillow's own guard trips
    assert len(bomb) < 150_000
    expected = "the image is 30000×30000 pixels (900.0 megapixels); the limit is 0.25 megapixels"
    attack(server, f"image: {expected}", image={"url": "data:image/png;base64," + base64.b64encode(bomb).decode()})
    attack(server, f"image: {expected}", image=_upload(server, "bomb.png", bomb))
    attack(server, f"images: {expected}", images=[{"image": _upload(server, "bomb.png", bomb)}])


def test_files_that_are_not_images_are_refused(server):
    for name, data in (("notes.png", b"just text, not a picture\n" * 10), ("cut.png", _bytes(_noise())[:200]),
                       ("page.png", b"<html><script>alert(1)</script></html>")):
        attack(server, IMAGE_NO, image=_upload(server, name, data))


def test_a_polyglot_image_is_read_as_the_image_and_nothing_else(server):
    """A PNG with an HTML page and a zip appended: the decoder reads the picture, the rest is never looked at (the
    answer is the clean PNG's) and nothing of it comes back."""
    import zipfile

    clean = _bytes(_noise(5))
    archive = io.BytesIO()
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("payload.txt", "zip payload")
    polyglot = clean + b"<html><script>alert('polyglot')</script></html>" + archive.getvalue()
    results = attack(server, None, image=_upload(server, "poly.png", polyglot))
    assert _answer_of(results) == _answer_of(_answer(server, image={"url": _data_url(_noise(5))}))
    assert "polyglot" not in json.dumps(results) and "payload" not in json.dumps(results)


def _gradient(size=(64, 48)) -> np.ndarray:
    x = np.linspace(0.0, 1.0, size[0])[None, :] * np.linspace(0.2, 1.0, size[1])[:, None]
    return x


def test_a_16_bit_image_is_scaled_not_clipped(server):
    """Mode I;16 (a 16-bit greyscale PNG) answers as its 8-bit equivalent does, not as a white image."""
    grey16 = Image.fromarray((_gradient() * 65535).astype(np.uint16))
    assert Image.open(io.BytesIO(_bytes(grey16))).mode == "I;16"
    grey8 = Image.fromarray(np.rint(_gradient() * 65535 / 257).astype(np.uint8), "L")
    as_8_bit = _answer_of(_answer(server, image={"url": _data_url(grey8)}, max_new_tokens=8))
    white = _answer_of(_answer(server, image={"url": _data_url(Image.new("L", (64, 48), 255))}, max_new_tokens=8))
    assert as_8_bit != white  # so the test tells the two apart
    for sent in ({"image": {"url": _data_url(grey16)}}, {"image": _upload(server, "g16.png", _bytes(grey16))},
                 {"images": [{"image": {"url": _data_url(grey16)}}]}):
        results = attack(server, None, max_new_tokens=8, **sent)
        assert _answer_of(results) == as_8_bit


def test_a_cmyk_jpeg_answers_as_its_rgb_conversion(server):
    cmyk = _noise(6).convert("CMYK")
    data = _bytes(cmyk, "JPEG", quality=95)
    rgb = Image.open(io.BytesIO(data)).convert("RGB")
    results = attack(server, None, image=_upload(server, "cmyk.jpg", data), max_new_tokens=8)
    assert _answer_of(results) == _answer_of(_answer(server, image={"url": _data_url(rgb)}, max_new_tokens=8))


def test_exif_rotation_is_applied(server):
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90° clockwise to display"
    data = _bytes(_noise(7, (64, 48)), "JPEG", quality=95, exif=exif.tobytes())
    results = attack(server, None, image=_upload(server, "rotated.jpg", data))
    assert results["visuals"]["images"] == [[48, 64]]


def test_an_animated_gif_is_read_as_its_first_frame(server):
    frames = [_noise(8).quantize(64), _noise(9).quantize(64), _noise(10).quantize(64)]
    buf = io.BytesIO()
    frames[0].save(buf, "GIF", save_all=True, append_images=frames[1:], duration=100, loop=0)
    results = attack(server, None, image=_upload(server, "anim.gif", buf.getvalue()), max_new_tokens=8)
    first = Image.open(io.BytesIO(buf.getvalue())).convert("RGB")
    assert _answer_of(results) == _answer_of(_answer(server, image={"url": _data_url(first)}, max_new_tokens=8))


def test_too_many_images_are_refused_before_any_is_read(server):
    small = {"image": {"url": _data_url(Image.new("RGB", (8, 8), (1, 2, 3)))}}
    attack(server, "images: 65 images; the limit is 64", images=[small] * 65)
    attack(server, "images: 5000 images; the limit is 64", images=[small] * 5000)


def test_more_images_than_the_run_holds_get_one_piece_of_advice_that_works(server):
    """The model's context (2,048 tokens) is looser than this server's run limit (1,024): the message is the run
    limit's, and the number of images it names is then taken."""
    tiny = {"image": {"url": _data_url(Image.new("RGB", (8, 8), (50, 60, 70)))}}
    kind, message = _send(server, images=[tiny] * 64)
    assert kind == "error" and "over this run's limit of 1024: at most" in message, message
    fit = int(message.split("at most ")[1].split()[0])
    assert 1 < fit < 64
    attack(server, message, images=[tiny] * 64)
    results = attack(server, None, images=[tiny] * fit, max_new_tokens=4)
    assert len(results["visuals"]["images"]) == fit


def test_a_model_context_below_the_images_still_gives_the_run_limits_advice(tiny_llama):
    """The case where the two limits used to disagree: 64 images pass the model's context (900 tokens here) and the
    run limit (500) is tighter still. One message, the tighter limit's, whose count is then taken."""
    import dataclasses

    import gradio as gr

    from ui.app_builder import build_app
    from ui.controller import SessionBox

    loaded = dataclasses.replace(tiny_llama, max_context=900)
    ctl = build_app(Engine(loaded), max_new_tokens_limit=8,
                    limits=dataclasses.replace(LIMITS, max_run_tokens=500)).controller
    image = Image.new("RGB", (8, 8), (50, 60, 70))
    try:
        with pytest.raises(gr.Error, match=r"over this run's limit of 500: at most \d+ of them fit") as info:
            list(ctl.compare(None, "Describe.", ["full"], 0.3, 4, box=SessionBox(), images=[image] * 64))
        fit = int(str(info.value).split("at most ")[1].split()[0])
        list(ctl.compare(None, "Describe.", ["full"], 0.3, 4, box=(box := SessionBox()), images=[image] * fit))
        assert box.run.to_dict()["finished"]
    finally:
        ctl.registry.close()


# -- videos -----------------------------------------------------------------------------------------------------

def _frames(n, size=(64, 48)):
    return [Image.new("RGB", size, ((7 * i) % 256, 90, 160)) for i in range(n)]


def _gop_clip(path: Path, n: int, keyint: int) -> bytes:
    codec = "libx264" if "libx264" in av.codecs_available else "mpeg4"
    with av.open(str(path), "w") as container:
        options = {"g": str(keyint), "keyint_min": str(keyint), "sc_threshold": "0"} if codec == "libx264" else {}
        stream = container.add_stream(codec, rate=30, options=options)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        if codec == "mpeg4":
            stream.codec_context.gop_size = keyint
        for image in _frames(n):
            container.mux(stream.encode(av.VideoFrame.from_image(image)))
        container.mux(stream.encode())
    return path.read_bytes()


def test_corrupt_truncated_and_trackless_videos_are_refused(server, tmp_path):
    clip = CLIP.read_bytes()
    audio = tmp_path / "sound.mp4"
    with av.open(str(audio), "w") as container:
        stream = container.add_stream("aac", rate=16000)
        for _ in range(4):
            frame = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp", layout="mono")
            frame.sample_rate = 16000
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    for name, data in (("noise.mp4", np.random.default_rng(0).bytes(5000)), ("cut.mp4", clip[:2000]),
                       ("sound.mp4", audio.read_bytes()), ("picture.mp4", _bytes(_noise()))):
        attack(server, VIDEO_NO, video=_upload(server, name, data))


def test_a_video_over_the_byte_limit_is_refused_for_its_size(server):
    """The upload route holds a file to the larger of the two file limits; a file in the upload folder over the
    video's (put there another way) is refused for its size, before it is opened as a video."""
    r = httpx.post(server.api + "upload", files={"files": ("big.mp4", os.urandom(410_000), "video/mp4")})
    assert r.status_code == 413
    big = _in_uploads("big.mp4")
    big.write_bytes(os.urandom(410_000))
    try:
        attack(server, "video: the video is 0.4 MB; the limit is 0.38147 MB: send a shorter or smaller clip",
               video={"path": str(big), "meta": MARK})
    finally:
        big.unlink()


def test_video_frames_over_the_pixel_limit_from_the_header(server):
    attack(server, "video: the video is 640×480 pixels per frame; the limit is 0.2 megapixels: send a smaller "
                   "video", video=_upload(server, "big-frames.mp4", write_video(_frames(2, (640, 480)),
                                                                               server.private / "b.mp4").read_bytes()))
    attack(server, "video: 20 frames of 384×384 pixels are 3 megapixels; the limit is 2.5: ask for at most 16 frames",
           prefix=True, video=_upload(server, "clip.mp4", CLIP.read_bytes()), frames=20)


def test_video_frames_larger_than_the_header_says_are_refused_as_they_decode(server, tmp_path):
    """An MJPEG AVI whose header and first frame are 64 x 48 and whose later frames are 640 x 480."""
    path = tmp_path / "grows.avi"
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mjpeg", rate=8)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuvj420p"
        for k, size in enumerate([(64, 48)] + [(640, 480)] * 7):
            packet = av.Packet(_bytes(Image.new("RGB", size, (30 * k, 40, 50)), "JPEG", quality=30))
            packet.stream, packet.pts, packet.dts, packet.time_base = stream, k, k, Fraction(1, 8)
            container.mux(packet)
    assert path.stat().st_size < 100_000
    attack(server, "video: a frame of the video is 640×480 pixels (its header says 64×48); the limit is 0.2 "
                   "megapixels a frame: send a smaller video", video=_upload(server, "grows.avi", path.read_bytes()),
           frames=4)


def test_a_long_video_costs_the_frames_asked_not_the_frames_in_it(server, tmp_path):
    """3,000 frames: with a keyframe every 30, one frame asked decodes a handful and eight frames a few groups;
    with one keyframe, eight frames would mean decoding nearly all of them, refused before any is decoded."""
    gops = _upload(server, "long.mp4", _gop_clip(tmp_path / "long.mp4", 3000, keyint=30))
    one = attack(server, None, video=gops, frames=1)["visuals"]["video"]
    assert one["total_frames"] == 3000 and one["frames"] == 1 and one["decoded_frames"] <= 4
    eight = attack(server, None, video=gops, frames=8)["visuals"]["video"]
    assert eight["frames"] == 8 and eight["decoded_frames"] <= 8 * 30 + 8
    single = _upload(server, "one-key.mp4", _gop_clip(tmp_path / "one-key.mp4", 3000, keyint=10_000))
    attack(server, "video: reaching 8 sampled frames means decoding ", prefix=True, video=single, frames=8)
    kind, message = _send(server, video=single, frames=8)
    assert "its keyframes are far apart); the limit is 0.005 gigapixels: ask for fewer frames" in message


@pytest.mark.parametrize("frames", [0, 65, 2.5, "8", -1])
def test_frame_counts_out_of_range(server, frames):
    attack(server, f"frames must be a whole number from 1 to 64, got {frames!r}", prefix=True,
           video=_upload(server, "clip.mp4", CLIP.read_bytes()), frames=frames)


# -- the table of docs/security.md --------------------------------------------------------------------------------

def test_every_kind_is_listed_in_docs_security_with_its_message():
    text = (ROOT / "docs" / "security.md").read_text()
    section = text.split("## Every input kind", 1)[1].split("\n## ", 1)[0]
    rows = {line.split("|")[1].strip(): line for line in section.splitlines() if line.startswith("| ")}
    for kind, words in KINDS.items():
        assert kind in rows, f"docs/security.md has no row for {kind!r}"
        assert words in rows[kind], f"docs/security.md's row for {kind!r} does not give its message ({words!r})"
    assert set(rows) - {"kind"} == set(KINDS), set(rows) ^ set(KINDS)
