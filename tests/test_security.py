"""The app's boundary against a hostile client: every attack shape found by hand is refused with a message
that names the field (and, for files, says nothing about the disk), no pixel of a server file comes back,
memory is bounded per session and freed, Stop/Clear/disconnect touch only their own session, and expected
rejections are one log line, never a traceback.

The app runs on a free loopback port with the tiny model (serve_app); raw HTTP goes through Gradio's
two-step /call API, gradio_client through the queue like the browser."""
import base64
import io
import json
import logging
import os
import re
import threading
from pathlib import Path
from types import SimpleNamespace

import httpx
import numpy as np
import pytest
from PIL import Image

from prefixkv_core import METHODS, Engine
from prefixkv_core.limits import IMAGE_REFUSED, MB, LimitError, Limits
from prefixkv_core.session.video_input import VIDEO_REFUSED
from prefixkv_core.testing import wait_until

SECRET_RGB = (255, 0, 255)  # no tiny-model overlay or test image is pure magenta
# one run at a time: the queue's behaviour (a second user waits, Stop cancels it) is tested with this server
LIMITS = Limits(max_image_bytes=300_000, max_image_pixels=250_000, max_prompt_tokens=256, max_run_tokens=1024,
                max_sessions=3, idle_s=600, cache_limit_bytes=None, memory_limit_bytes=None, max_batch_users=1,
                max_video_bytes=200_000, max_video_pixels=5_000_000)
REFUSED = f"image: {IMAGE_REFUSED}"
VIDEO_REFUSED_AS_SENT = f"video: {VIDEO_REFUSED}"
CLIP = Path(__file__).resolve().parent.parent / "assets" / "videos" / "clip-0.mp4"


# -- fixtures and helpers ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(tiny_llama, serve_app, api_client):
    url = serve_app(Engine(tiny_llama), max_new_tokens_limit=64, limits=LIMITS)
    demo = serve_app.demos[-1]
    return SimpleNamespace(url=url, api=url + "gradio_api/", demo=demo, ctl=demo.controller,
                           client=lambda: api_client(url))


@pytest.fixture(scope="module")
def secret(tmp_path_factory):
    """A distinctive image on the server's disk, outside every folder the app may read."""
    path = tmp_path_factory.mktemp("server-private") / "secret.png"
    Image.new("RGB", (64, 48), SECRET_RGB).save(path)
    return str(path)


@pytest.fixture(scope="module")
def noise_file(tmp_path_factory, noise_image):
    path = tmp_path_factory.mktemp("client") / "noise.png"
    noise_image.save(path)
    return str(path)


def _inputs(server, api: str = "/compare", **values):
    """Every input of an endpoint in order (defaults from /gradio_api/info; None for the session state)."""
    params = httpx.get(server.api + "info").json()["named_endpoints"][api]["parameters"]
    out = [values.pop(p["parameter_name"], p.get("parameter_default")) for p in params]
    assert not values, f"unknown inputs {values}"
    if api == "/compare":
        out.insert(9, None)  # the gr.State slot after seed
    return out


def _raw(server, api: str, data, body: str | None = None):
    """POST a /call request, follow its event stream; returns ("complete", data) or ("error", message)."""
    text = body if body is not None else json.dumps({"data": data})
    r = httpx.post(server.api + f"call/{api.strip('/')}", content=text, timeout=60,
                   headers={"content-type": "application/json"})
    if r.status_code != 200:
        return "http", r.status_code
    event_id = r.json()["event_id"]
    kind = None
    with httpx.stream("GET", server.api + f"call/{api.strip('/')}/{event_id}", timeout=120) as stream:
        for line in stream.iter_lines():
            if line.startswith("event:"):
                kind = line[6:].strip()
            elif line.startswith("data:") and kind in ("complete", "error"):
                payload = json.loads(line[5:].strip())
                if kind == "error":
                    return "error", (payload or {}).get("error")
                return "complete", payload
    return None, None


def _data_url(image: Image.Image, fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    image.save(buf, fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


def _has_secret_pixels(image: Image.Image) -> bool:
    arr = np.asarray(image.convert("RGB")).reshape(-1, 3)
    return bool((arr == np.array(SECRET_RGB)).all(axis=1).any())


def _upload_dir() -> Path:
    from ui.inputs import upload_folder

    path = Path(upload_folder())
    path.mkdir(parents=True, exist_ok=True)
    return path



# -- 1. server files -----------------------------------------------------------------------------------------

def test_server_files_are_refused_with_one_message(server, secret, tmp_path):
    upload = _upload_dir()
    link = upload / f"link-{os.getpid()}.png"
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(secret)
    meta = {"_type": "gradio.FileData"}
    try:
        attempts = [
            {"path": secret},                                      # no file marker: gradio's check is skipped
            {"path": secret, "meta": meta},                        # with the marker: gradio's own refusal
            {"path": secret, "orig_name": "cat.png", "size": 10},
            {"path": str(upload / ".." / Path(secret).relative_to("/"))},  # climbing out of the upload folder
            {"path": str(link)},                                   # a symlink inside the upload folder
            {"path": str(link), "meta": meta},
            {"path": "/nonexistent/dir/x.png"},                    # missing, folder, device, not an image:
            {"path": "/nonexistent/dir/x.png", "meta": meta},      # the same answer as an existing image
            {"path": str(tmp_path)},
            {"path": "/dev/zero"},
            {"path": "/etc/passwd"},
            {"path": secret, "url": "http://127.0.0.1:1/x.png"},
            {"path": "https://example.com/huge.png", "meta": meta},  # never fetched by the server
            {"path": "http://127.0.0.1:1/x.png", "meta": meta, "orig_name": "x.png"},
        ]
        messages = set()
        for payload in attempts:
            kind, message = _raw(server, "compare", _inputs(server, image=payload, prompt="hi", methods=["full"],
                                                            max_new_tokens=2))
            assert kind == "error", payload
            messages.add(message)
        assert messages == {REFUSED}
    finally:
        link.unlink()

    # through gradio_client too: nothing streams back, so no pixel of the file can
    client = server.client()
    job = client.submit({"path": secret}, "Describe.", ["full", "snapkv"], 0.3, 4, api_name="/compare")
    with pytest.raises(Exception, match="not a readable image"):
        job.result(timeout=60)
    assert job.outputs() == []
    client.close()

    # a direct call with a path string: the engine itself refuses (the app passes its allowed folders)
    from ui.controller import SessionBox

    with pytest.raises(Exception, match="not a readable image"):
        list(server.ctl.compare(secret, "hi", ["full"], 0.3, 2, box=SessionBox()))


def test_images_that_are_allowed_still_work_and_no_secret_pixel_comes_back(server, secret, noise_file):
    from gradio_client import handle_file

    from ui.app_builder import ASSETS

    client = server.client()
    outputs = []
    for image in (handle_file(noise_file), {"path": str(ASSETS / "chelsea.jpg")},
                  {"url": _data_url(Image.open(noise_file))}):
        out = client.predict(image, "Describe.", ["full", "h2o"], 0.3, 3, api_name="/compare")
        assert out[-1]["finished"] and out[-1]["prefill"]["image_tokens"] == 16
        outputs.append(out)
    for out in outputs:  # every overlay the gallery offered, fetched like a browser would
        gallery = out[1 + 2 * len(METHODS) + 5]  # status, a header and a chat per offered method, then the charts
        assert len(gallery) == 2
        for item in gallery:
            url = item["image"]["url"]
            image = Image.open(io.BytesIO(httpx.get(url if url.startswith("http") else server.url + url).content))
            assert not _has_secret_pixels(image)
        assert secret not in json.dumps(out, default=str)
    client.close()


def test_gradio_file_route_refuses_paths_outside_the_examples(server, secret):
    from ui.app_builder import ASSETS

    for path in (secret, "/etc/passwd", str(ASSETS / ".." / ".." / "app.py")):
        assert httpx.get(server.api + "file=" + path).status_code in (403, 404)
    assert httpx.get(server.api + "file=" + str(ASSETS / "chelsea.jpg")).status_code == 200


def test_server_files_named_as_more_images_or_a_video_are_refused_with_one_message(server, secret, tmp_path):
    """The gallery and the video input hold the image's line: a path that was not uploaded (with Gradio's marker or
    without, through a symlink, missing, a folder, a device, not a video) gets one sentence per input, nothing else
    is opened, and nothing streams back."""
    upload = _upload_dir()
    link = upload / f"link-{os.getpid()}.mp4"
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(secret)
    meta = {"_type": "gradio.FileData"}
    try:
        paths = [{"path": secret}, {"path": secret, "meta": meta}, {"path": str(link)}, {"path": str(link), "meta": meta},
                 {"path": "/nonexistent/clip.mp4"}, {"path": str(tmp_path)}, {"path": "/dev/zero"},
                 {"path": "/etc/passwd"}, {"path": "https://example.com/huge.mp4", "meta": meta},
                 {"path": str(upload / ".." / Path(secret).relative_to("/")), "meta": meta}]
        for field, wrap, expected in (("video", lambda p: p, VIDEO_REFUSED_AS_SENT),
                                      ("images", lambda p: [{"image": p}], f"images: {IMAGE_REFUSED}")):
            messages = set()
            for payload in paths:
                kind, message = _raw(server, "compare", _inputs(server, prompt="hi", methods=["full"],
                                                                max_new_tokens=2, **{field: wrap(payload)}))
                assert kind == "error", (field, payload)
                messages.add(message)
            assert messages == {expected}
    finally:
        link.unlink()
    # a text file uploaded properly but named .mp4, and a truncated clip: not a video, the same sentence
    fake = upload / f"fake-{os.getpid()}.mp4"
    fake.write_bytes(b"hello, not a video")
    cut = upload / f"cut-{os.getpid()}.mp4"
    cut.write_bytes(CLIP.read_bytes()[:2000])
    try:
        for bad in (fake, cut):
            kind, message = _raw(server, "compare", _inputs(server, prompt="hi", methods=["full"], max_new_tokens=2,
                                                            video={"path": str(bad), "meta": meta}))
            assert (kind, message) == ("error", VIDEO_REFUSED_AS_SENT)
    finally:
        fake.unlink()
        cut.unlink()

    client = server.client()  # through gradio_client: nothing comes back
    job = client.submit(None, "Describe.", ["full"], 0.3, 2, video={"path": secret}, api_name="/compare")
    with pytest.raises(Exception, match="not a readable video"):
        job.result(timeout=60)
    assert job.outputs() == []
    client.close()
    from ui.controller import SessionBox  # a direct call: the controller checks paths itself

    with pytest.raises(Exception, match="video: not a readable video"):
        list(server.ctl.compare(None, "hi", ["full"], 0.3, 2, box=SessionBox(), video=secret))
    with pytest.raises(Exception, match="image 2 of 2: not a readable image"):
        list(server.ctl.compare(None, "hi", ["full"], 0.3, 2, box=SessionBox(), images=[Image.new("RGB", (8, 8)), secret]))


def test_video_limits_are_checked_before_decoding(server):
    """Bytes from the file's size, before it is opened as a video (random bytes over the limit are refused for
    their size, not for what they are); the frames' pixels from the stream's header; the upload route holds a
    video to the larger of the two file limits."""
    meta = {"_type": "gradio.FileData"}
    big = _upload_dir() / f"big-{os.getpid()}.mp4"
    big.write_bytes(os.urandom(250_000))
    try:
        kind, message = _raw(server, "compare", _inputs(server, prompt="hi", methods=["full"], max_new_tokens=2,
                                                        video={"path": str(big), "meta": meta}))
        assert kind == "error" and message.startswith("video: the video is 0.2 MB; the limit is 0.190735 MB")
    finally:
        big.unlink()
    from ui.controller import SessionBox

    with pytest.raises(Exception, match=r"video: the video is 0\.0 MB; the limit is 0\.00476837 MB"):
        _with_limits(server, max_video_bytes=5_000)  # a real clip, over a smaller limit: refused the same way
    # 40 frames of 384 x 384 are 5.9 megapixels: over this server's 5, refused from the header
    with pytest.raises(Exception, match=r"40 frames of 384×384 pixels are 6 megapixels; the limit is 5: ask for at most "
                                        r"33 frames"):
        list(server.ctl.compare(None, "hi", ["full"], 0.3, 2, box=SessionBox(), video=str(CLIP), frames=40))
    r = httpx.post(server.api + "upload", files={"files": ("big.mp4", b"\0" * 310_000, "video/mp4")})
    assert r.status_code == 413


def _with_limits(server, **changes):
    """A compare on this server's model with other limits (a direct call: the controller's own checks)."""
    from dataclasses import replace

    from ui.app_builder import build_app
    from ui.controller import SessionBox

    ctl = build_app(server.ctl.engine, max_new_tokens_limit=8, limits=replace(LIMITS, **changes)).controller
    try:
        list(ctl.compare(None, "hi", ["full"], 0.3, 2, box=SessionBox(), video=str(CLIP)))
    finally:
        ctl.registry.close()


def test_a_video_and_several_images_that_are_allowed_work_and_show_no_secret_pixel(server, secret, noise_file):
    from gradio_client import handle_file

    from ui.visual_panel import MULTI_ASSETS

    client = server.client()
    out = client.predict(None, "Which image?", ["full", "h2o"], 0.3, 2,
                         images=[{"image": handle_file(noise_file)}, {"image": {"path": str(MULTI_ASSETS / "multi-0-1.png")}},
                                 {"image": {"url": _data_url(Image.open(noise_file))}}],
                         video=handle_file(str(CLIP)), frames=3, api_name="/compare")
    results = out[-1]
    assert results["finished"] and results["prefill"]["image_tokens"] == 16 * 6
    assert len(results["visuals"]["images"]) == 3 and results["visuals"]["video"]["frames"] == 3
    for item in out[1 + 2 * len(METHODS) + 5]:
        url = item["image"]["url"]
        image = Image.open(io.BytesIO(httpx.get(url if url.startswith("http") else server.url + url).content))
        assert not _has_secret_pixels(image)
    client.close()


# -- 3. one size limit for every way an image arrives --------------------------------------------------------

def test_image_limits_apply_to_uploads_data_urls_and_file_objects(server):
    rng = np.random.RandomState(1)
    big = Image.fromarray((rng.rand(400, 400, 3) * 255).astype("uint8"))  # ~480 kB as PNG: over 300 kB
    kind, message = _raw(server, "compare", _inputs(server, image={"url": _data_url(big)}, prompt="hi",
                                                    methods=["full"], max_new_tokens=2))
    assert kind == "error" and "the limit is 0.286102 MB" in message and message.startswith("image: the image is")

    upload = _upload_dir() / f"big-{os.getpid()}.png"
    big.save(upload)
    try:
        for payload in ({"path": str(upload)}, {"path": str(upload), "meta": {"_type": "gradio.FileData"}}):
            kind, message = _raw(server, "compare", _inputs(server, image=payload, prompt="hi", methods=["full"],
                                                            max_new_tokens=2))
            assert kind == "error" and "the limit is 0.286102 MB" in message
    finally:
        upload.unlink()

    # the upload route: gradio's own limit, set from the same number
    r = httpx.post(server.api + "upload", files={"files": ("big.png", b"\0" * 400_000, "image/png")})
    assert r.status_code == 413
    # a data URL far over the limit never reaches Gradio: the body itself is refused
    huge = json.dumps({"data": _inputs(server, image={"url": "data:image/png;base64," + "A" * (37 * MB)})})
    assert _raw(server, "compare", None, body=huge) == ("http", 413)

    # pixels are checked from the header, before decoding: 600 x 600 of one colour is a tiny PNG
    flat = Image.new("RGB", (600, 600), (10, 20, 30))
    kind, message = _raw(server, "compare", _inputs(server, image={"url": _data_url(flat)}, prompt="hi",
                                                    methods=["full"], max_new_tokens=2))
    assert kind == "error" and "600×600 pixels" in message and "0.25 megapixels" in message
    for bad in ("data:image/png;base64,!!!notbase64", "data:text/plain,hello", "data:image/png;base64,aGVsbG8="):
        assert _raw(server, "compare", _inputs(server, image={"url": bad}, prompt="hi", methods=["full"],
                                               max_new_tokens=2)) == ("error", REFUSED)


# -- 4. limits counted in tokens -----------------------------------------------------------------------------

def test_prompt_limits_count_tokens_as_well_as_characters(server):
    kind, message = _raw(server, "compare", _inputs(server, prompt="\U0001F600" * 1500, methods=["full"],
                                                    max_new_tokens=2))
    assert kind == "error" and "tokens (1500 characters); the limit is 256 tokens" in message
    kind, message = _raw(server, "compare", _inputs(server, prompt="x" * 2001, methods=["full"], max_new_tokens=2))
    assert kind == "error" and "2001 characters; the limit is 2000" in message


def test_run_and_conversation_token_limits(tiny_llama, noise_image):
    from ui.app_builder import build_app
    from ui.controller import SessionBox

    demo = build_app(Engine(tiny_llama), max_new_tokens_limit=64,
                     limits=Limits(max_run_tokens=60, cache_limit_bytes=None, memory_limit_bytes=None))
    ctl = demo.controller
    with pytest.raises(Exception, match=r"this run would reach \d+ tokens .*the limit is 60"):
        list(ctl.compare(noise_image, "Describe the picture.", ["full"], 0.3, 40, box=SessionBox()))
    box = SessionBox()
    list(ctl.compare(noise_image, "Describe.", ["full"], 0.3, 10, box=box))
    with pytest.raises(Exception, match="the conversation would reach .* the limit is 60"):
        list(ctl.follow_up("And what else is there in the picture, in every detail?", box))
    ctl.registry.close()


# -- 5/6. type errors name the field -------------------------------------------------------------------------

TYPE_CASES = [
    (dict(budget="abc"), "budget must be a number from 0.05 to 1, got 'abc'"),
    (dict(budget=[0.3]), "budget must be a number from 0.05 to 1"),
    (dict(max_new_tokens="lots"), "max_new_tokens must be a whole number from 1 to 64, got 'lots'"),
    (dict(max_new_tokens=10**9), "max_new_tokens must be a whole number from 1 to 64"),
    (dict(seed=1e30), "seed must be a whole number from 0 to 4294967295, got 1e+30"),
    (dict(seed="x"), "seed must be a whole number from 0 to 4294967295, got 'x'"),
    (dict(seed=-1), "seed must be a whole number from 0 to 4294967295, got -1"),
    (dict(do_sample="yes"), "do_sample must be true or false, got 'yes'"),
    (dict(temperature="hot"), "temperature must be a number from 0.05 to 2"),
    (dict(top_p={"p": 1}), "top_p must be a number from 0.05 to 1"),
    (dict(methods=None), "no method selected: methods must be a list of method names"),
    (dict(methods=5), "methods must be a list of any of: full, local"),
    (dict(methods="fullx"), "methods: ['fullx'] not accepted"),
    (dict(methods=["full", {"x": 1}]), "not accepted; methods must be a list of any of"),
    (dict(prompt=["a", "b"]), "prompt: one text at a time"),
    (dict(prompt=12), "prompt must be text of at most 2000 characters, got 12"),
    (dict(snapkv__window="big"), "snapkv__window must be a whole number"),
    (dict(elastic__normalised_importance="yes"), "elastic__normalised_importance must be true or false"),
    (dict(lookm__merge="median"), "lookm__merge must be one of: pivotal, average, weighted"),
    (dict(zipvl__tau=7), "zipvl__tau must be a number"),
    (dict(image="abc"), "image must be null, a file object from the upload route"),
    (dict(image=123), "image must be null, a file object from the upload route"),
    (dict(images="abc"), "images must be null or a list of"),
    (dict(images=[{"image": 5}]), "images must be null or a list of"),
    (dict(video=123), "video must be null or a file object from the upload route"),
    (dict(frames=0), "frames must be a whole number from 1 to 64, got 0"),
    (dict(frames=65), "frames must be a whole number from 1 to 64, got 65"),
    (dict(frames=2.5), "frames must be a whole number from 1 to 64, got 2.5"),
    (dict(frames="x"), "frames must be a whole number from 1 to 64, got 'x'"),
]


@pytest.mark.parametrize("values,message", TYPE_CASES, ids=[next(iter(v)) + "=" + repr(v[next(iter(v))])[:20]
                                                            for v, _ in TYPE_CASES])
def test_type_errors_name_the_field_and_what_it_accepts(server, values, message):
    values = {"prompt": "hi", "methods": ["full", "snapkv", "elastic", "lookm", "zipvl"], "max_new_tokens": 2,
              **values}
    kind, got = _raw(server, "compare", _inputs(server, **values))
    assert kind == "error"
    assert message in got


def test_not_a_number_and_short_requests(server):
    body = json.dumps({"data": _inputs(server, prompt="hi", methods=["full"], max_new_tokens=2, budget=0.123)})
    kind, message = _raw(server, "compare", None, body=body.replace("0.123", "NaN"))
    assert kind == "error" and "budget must be a number from 0.05 to 1, got nan" in message
    body = json.dumps({"data": _inputs(server, prompt="hi", methods=["h2o"], max_new_tokens=2, h2o__recent_fraction=0.5)})
    kind, message = _raw(server, "compare", None, body=body.replace("0.5", "Infinity"))
    assert kind == "error" and "h2o__recent_fraction must be a number" in message and "got inf" in message
    kind, message = _raw(server, "compare", [None, "hi", ["full"], 0.3, 2])
    assert kind == "error" and re.match(r"/compare takes \d+ values, got 5: send every input", message)


def test_methods_as_a_string_is_read_as_a_list(server):
    client = server.client()
    out = client.predict(None, "hello", "full, h2o", 0.3, 2, api_name="/compare")
    assert set(out[-1]["methods"]) == {"full", "h2o"} and out[-1]["finished"]
    client.close()


@pytest.mark.parametrize("knob,value,message", [
    ("pyramidkv__beta", 0, "beta"), ("h2o__recent_fraction", 5, "recent_fraction"),
    ("snapkv__window", 10**6, "window"), ("zipvl__group_size", -3, "group_size")])
def test_knob_ranges_are_refused_by_the_policies(server, knob, value, message):
    method = knob.split("__")[0]
    kind, got = _raw(server, "compare", _inputs(server, prompt="hi", methods=[method], max_new_tokens=2,
                                                **{knob: value}))
    assert kind == "error" and message in got


# -- 7. Stop, Clear, disconnect, logs, exports ---------------------------------------------------------------

def test_stop_cancels_a_queued_request_and_touches_no_one_else(server):
    from ui import queue_probe

    ctl = server.ctl
    a, b, c = server.client(), server.client(), server.client()
    assert c.predict(api_name="/stop") == "Nothing to stop: no comparison is running or waiting in this session."
    ctl.engine.lock.acquire()  # A's run waits for the model: deterministic "A is running, B is queued"
    try:
        job_a = a.submit(None, "first user", ["full", "snapkv"], 0.3, 6, api_name="/compare")
        assert wait_until(lambda: ctl.registry.count() >= 1 and a.session_hash in ctl.registry.owners(), timeout=20)
        job_b = b.submit(None, "second user", ["full"], 0.3, 6, api_name="/compare")
        assert wait_until(lambda: queue_probe.waiting(server.demo, b.session_hash, "engine") == 1, timeout=20)
        assert b.predict(api_name="/stop") == "■ The queued request will not start."
        # another user's Stop and Clear while A runs: nothing of A's changes
        assert c.predict(api_name="/stop").startswith("Nothing to stop")
        c.predict(api_name="/clear")
    finally:
        ctl.engine.lock.release()
    final_a = job_a.result(timeout=120)
    assert "Done" in final_a[0] and final_a[-1]["finished"] and final_a[-1]["prompts"] == ["first user"]
    assert {m["status"] for m in final_a[-1]["methods"].values()} == {"done"}
    final_b = job_b.result(timeout=120)
    assert "Stopped before it started" in final_b[0]
    # a Stop pressed before a request is sent does not cancel it
    out = b.predict(None, "second try", ["full"], 0.3, 2, api_name="/compare")
    assert "Done" in out[0] and out[-1]["prompts"] == ["second try"]
    for client in (a, b, c):
        client.close()


def test_a_client_that_leaves_mid_run_frees_the_model_and_its_caches(server, monkeypatch):
    monkeypatch.setenv("GRADIO_HEARTBEAT_INTERVAL", "0.2")
    ctl = server.ctl
    client = server.client()
    ctl.engine.lock.acquire()
    try:
        client.submit(None, "leaving soon", ["full", "h2o", "snapkv"], 0.3, 64, api_name="/compare")
        assert wait_until(lambda: client.session_hash in ctl.registry.owners(), timeout=20)
        session = ctl.registry.session_of(client.session_hash)
        client.close()  # the connection goes; nobody cancels the job
    finally:
        ctl.engine.lock.release()
    assert wait_until(lambda: client.session_hash not in ctl.registry.owners(), timeout=20)
    # released (if its run got the model only afterwards, what it built is dropped when it ends)
    assert wait_until(lambda: session.released and session.cache_bytes() == 0 and not ctl.engine.lock.locked(),
                      timeout=20)
    assert "closed" in ctl.registry.released_reason(client.session_hash)


def test_a_run_that_gets_the_model_after_its_release_builds_nothing(tiny_llama):
    from prefixkv_core import EngineError, GenerationSettings
    from ui.run_stream import drop_if_released

    session = Engine(tiny_llama).new_session(None, "hi", ["full", "h2o"], 0.3, GenerationSettings(max_new_tokens=3))
    session.release()  # its client left while the run waited for the model
    with pytest.raises(EngineError, match="released"):
        list(drop_if_released(session, session.run()))
    assert session.released and session.cache_bytes() == 0


def test_expected_rejections_log_one_line_and_no_traceback(server, secret, capfd, caplog, monkeypatch):
    from ui import inputs

    monkeypatch.setattr(inputs, "_REFUSAL_LOG", inputs._LogBudget())  # earlier tests used this minute's lines
    caplog.set_level(logging.INFO, logger="ui.inputs")
    capfd.readouterr()
    bad = [dict(budget="abc"), dict(methods=None), dict(seed=1e30), dict(image={"path": secret}),
           dict(image={"path": secret, "meta": {"_type": "gradio.FileData"}}), dict(prompt="\U0001F600" * 1500),
           dict(snapkv__window="big"), dict(pyramidkv__beta=0), dict(image="abc")]
    for values in bad:
        values = {"prompt": "hi", "methods": ["full", "snapkv", "pyramidkv"], "max_new_tokens": 2, **values}
        assert _raw(server, "compare", _inputs(server, **values))[0] == "error"
    assert _raw(server, "compare", [None, "hi"])[0] == "error"
    out, err = capfd.readouterr()
    assert "Traceback" not in out + err
    refused = [r for r in caplog.records if r.getMessage().startswith("refused:")]
    assert len(refused) == len(bad) + 1
    assert all("\n" not in r.getMessage() for r in refused)


def test_refusal_log_is_rate_limited(caplog):
    from ui.inputs import _LogBudget

    caplog.set_level(logging.INFO, logger="ui.inputs")
    budget = _LogBudget(per_minute=5)
    for i in range(40):
        budget.log(f"attempt {i}")
    assert len([r for r in caplog.records if "attempt" in r.getMessage()]) == 5
    assert budget.dropped == 35


def test_export_folders_are_removed(tiny_llama, noise_image):
    from ui.app_builder import build_app
    from ui.controller import SessionBox

    ctl = build_app(Engine(tiny_llama), methods="full,h2o", max_new_tokens_limit=8,
                    limits=Limits(cache_limit_bytes=None, memory_limit_bytes=None)).controller
    ctl.exports.max_folders = 2
    user = SimpleNamespace(session_hash="export-user")
    box = SessionBox()
    list(ctl.compare(noise_image, "Describe.", ["full", "h2o"], 0.3, 3, box=box, request=user))
    first = ctl.export(["html"], box, user)[0]["value"][0]
    second = ctl.export(["html"], box, user)[0]["value"][0]
    assert not Path(first).exists() and Path(second).exists()  # the previous export goes on the next one
    for other in ("u1", "u2", "u3"):
        other_box = SessionBox()
        list(ctl.compare(noise_image, "Hi.", ["full"], 0.3, 2, box=other_box, request=SimpleNamespace(session_hash=other)))
        ctl.export(["html"], other_box, SimpleNamespace(session_hash=other))
    assert len(ctl.exports.folders()) == 2  # bounded: the oldest went first
    ctl.disconnected(SimpleNamespace(session_hash="u3"))
    assert len(ctl.exports.folders()) == 1
    assert other_box.run.session is None and other_box.run.image is None  # a closed connection keeps neither
    assert sorted(os.listdir(ctl.exports.root)) == sorted(Path(f).name for f in ctl.exports.folders())
    ctl.exports.close()
    assert not Path(ctl.exports.root).exists()
    ctl.registry.close()


# -- 2. bounded per-session resources ------------------------------------------------------------------------

def test_page_loads_never_copy_the_model(server):
    """Gradio deep-copies component arguments on page loads: the session state's delete callback must
    reach the controller by reference, or every visit would copy the model."""
    import copy

    import gradio as gr

    state = next(b for b in server.demo.blocks.values() if isinstance(b, gr.State))
    clone = copy.deepcopy(state.delete_callback)
    assert clone._controller() is server.ctl
    assert httpx.head(server.url, timeout=30).status_code == 200


def test_least_recently_used_comparison_is_dropped_and_its_follow_up_says_so(server):
    clients = [server.client() for _ in range(LIMITS.max_sessions + 1)]
    for i, client in enumerate(clients):
        out = client.predict(None, f"user {i}", ["full", "h2o"], 0.3, 3, api_name="/compare")
        assert out[-1]["finished"]
        assert server.ctl.registry.count() <= LIMITS.max_sessions
    with pytest.raises(Exception, match="released to make room for newer comparisons; run Compare again"):
        clients[0].predict("And then?", api_name="/follow_up")
    follow = clients[-1].predict("And then?", api_name="/follow_up")
    assert follow[-1]["prompts"] == [f"user {len(clients) - 1}", "And then?"]
    for client in clients:
        client.close()


def test_idle_caches_are_released(tiny_llama, noise_image):
    from ui.app_builder import build_app
    from ui.controller import SessionBox

    ctl = build_app(Engine(tiny_llama), max_new_tokens_limit=8,
                    limits=Limits(idle_s=0.3, cache_limit_bytes=None, memory_limit_bytes=None)).controller
    box = SessionBox()
    # the session is read while the run streams: on a loaded machine it may be idle for 0.3 s right after it
    held = [box.run.session for _ in ctl.compare(noise_image, "Describe.", ["full", "snapkv"], 0.3, 3, box=box)
            if box.run is not None and box.run.session is not None]
    session = held[-1]
    assert box.run.to_dict()["methods"]["snapkv"]["kv_bytes"] > 0  # the run held caches
    assert wait_until(lambda: ctl.registry.count() == 0 and session.released, timeout=10)
    assert session.cache_bytes() == 0
    assert box.run.session is None and box.run.image is not None  # the session (and its image copy) let go
    with pytest.raises(Exception, match="idle for 0.3 seconds and its caches were released; run Compare again"):
        list(ctl.follow_up("And?", box))
    ctl.registry.close()


def test_memory_ceilings_refuse_a_new_run_with_a_message(tiny_llama, noise_image):
    from ui.app_builder import build_app
    from ui.controller import SessionBox

    ctl = build_app(Engine(tiny_llama), max_new_tokens_limit=8,
                    limits=Limits(cache_limit_bytes=1000, memory_limit_bytes=None)).controller
    with pytest.raises(Exception, match=r"the server is at its KV-cache limit .* the limit is 0 MB"):
        list(ctl.compare(noise_image, "Describe.", ["full"], 0.3, 3, box=SessionBox()))
    ctl.registry.close()
    ctl = build_app(Engine(tiny_llama), max_new_tokens_limit=8,
                    limits=Limits(cache_limit_bytes=None, memory_limit_bytes=1)).controller
    with pytest.raises(Exception, match="the server is low on memory"):
        list(ctl.compare(noise_image, "Describe.", ["full"], 0.3, 3, box=SessionBox()))
    ctl.registry.close()


class FakeSession:
    def __init__(self, nbytes: int):
        self.nbytes, self.released = nbytes, False

    def cache_bytes(self) -> int:
        return 0 if self.released else self.nbytes

    def release(self) -> None:
        self.released = True


def test_registry_frees_room_least_recently_used_first_and_never_a_running_one():
    from ui.sessions import SessionRegistry

    now = [0.0]
    registry = SessionRegistry(Limits(max_sessions=3, idle_s=100, cache_limit_bytes=1000, memory_limit_bytes=None),
                               clock=lambda: now[0])
    sessions = {}
    for name in ("a", "b", "c"):
        now[0] += 1
        registry.reserve(name, 300)
        sessions[name] = FakeSession(300)
        registry.add(name, sessions[name])
        registry.end(name)
    registry.begin("a")  # a runs again (a follow-up): most recent, and not to be dropped while it runs
    registry.reserve("d", 300)  # 900 held + 300 > 1000: the least recently used idle one (b) goes
    assert sessions["b"].released and not sessions["a"].released and not sessions["c"].released
    assert registry.released_reason("b").startswith("this comparison's caches were released because the server")
    with pytest.raises(LimitError, match="KV-cache limit"):
        registry.reserve("d", 2000)  # c goes too, a is running: still no room
    assert sessions["c"].released and not sessions["a"].released
    registry.end("a")
    now[0] += 150
    assert registry.sweep() == 1 and wait_until(lambda: sessions["a"].released, timeout=5)
    assert "idle for 1.66667 minutes" in registry.released_reason("a")
    registry.close()


def test_registry_counts_what_runs_going_at_once_may_still_reach():
    """Several users' runs go at once: each admitted run keeps its room until it ends, so two runs admitted
    together never share the same room."""
    from ui.sessions import SessionRegistry

    registry = SessionRegistry(Limits(max_sessions=4, cache_limit_bytes=1000, memory_limit_bytes=None))
    registry.reserve("a", 600)  # admitted, its caches not built yet
    with pytest.raises(LimitError, match="KV-cache limit"):
        registry.reserve("b", 600)  # 600 reserved by a's run + 600 > 1000
    registry.add("a", FakeSession(100))  # a's run has built 100 so far: it still counts its 600
    with pytest.raises(LimitError, match="KV-cache limit"):
        registry.reserve("b", 600)
    assert registry.running() == 1
    registry.end("a")  # a's run ended with 100 held: room for b now
    registry.reserve("b", 600)
    assert registry.running() == 0  # b is admitted, not yet added
    registry.close()


def test_registry_keeps_at_most_max_sessions_and_releases_on_disconnect():
    from ui.sessions import SessionRegistry

    registry = SessionRegistry(Limits(max_sessions=2, cache_limit_bytes=None, memory_limit_bytes=None))
    sessions = [FakeSession(10) for _ in range(4)]
    for i, s in enumerate(sessions):
        registry.add(f"u{i}", s)
        registry.end(f"u{i}")
    assert registry.owners() == ["u2", "u3"]
    assert wait_until(lambda: sessions[0].released and sessions[1].released, timeout=5)
    stopped = threading.Event()
    registry.add("u3", sessions[3], stop=stopped.set)  # the same owner again: replaces, nothing else
    assert registry.release_owner("u3", reason="closed") and stopped.is_set()
    assert wait_until(lambda: sessions[3].released, timeout=5) and registry.owners() == ["u2"]
    assert not registry.release_owner("nobody")
    registry.close()
    assert sessions[2].released and registry.held_bytes() == 0


# -- the settings ------------------------------------------------------------------------------------------

LIMIT_VARS = ("PREFIXKV_MAX_PROMPT_CHARS", "PREFIXKV_MAX_PROMPT_TOKENS", "PREFIXKV_MAX_RUN_TOKENS",
              "PREFIXKV_MAX_IMAGE_MB", "PREFIXKV_MAX_IMAGE_MEGAPIXELS", "PREFIXKV_MAX_VIDEO_MB",
              "PREFIXKV_MAX_VIDEO_MEGAPIXELS", "PREFIXKV_MAX_SESSIONS",
              "PREFIXKV_SESSION_IDLE_MINUTES", "PREFIXKV_CACHE_LIMIT_MB", "PREFIXKV_MEMORY_LIMIT_MB",
              "PREFIXKV_QUEUE_SIZE")


def test_limits_come_from_flags_and_environment(tiny_llama, monkeypatch):
    import app

    from prefixkv_core.limits import default_cache_limit, default_memory_limit

    for name in LIMIT_VARS:
        monkeypatch.delenv(name, raising=False)
    limits = app.build_limits(app.parse_args([]), tiny_llama)
    assert (limits.max_prompt_chars, limits.max_prompt_tokens, limits.max_run_tokens, limits.max_image_bytes,
            limits.max_image_pixels, limits.max_sessions, limits.idle_s) == (2000, 1024, 3072, 10 * MB, 40_000_000,
                                                                              6, 600)
    assert limits.cache_limit_bytes == default_cache_limit(tiny_llama) > 0
    assert limits.memory_limit_bytes == default_memory_limit()
    assert (limits.max_video_bytes, limits.max_video_pixels) == (64 * MB, 100_000_000)

    monkeypatch.setenv("PREFIXKV_MAX_SESSIONS", "2")
    monkeypatch.setenv("PREFIXKV_CACHE_LIMIT_MB", "off")
    monkeypatch.setenv("PREFIXKV_MEMORY_LIMIT_MB", "512")
    monkeypatch.setenv("PREFIXKV_MAX_VIDEO_MEGAPIXELS", "20")
    args = app.parse_args(["--max-image-mb", "2.5", "--session-idle-minutes", "0.5", "--queue-size", "8",
                           "--max-video-mb", "16"])
    limits = app.build_limits(args, tiny_llama)
    assert (limits.max_sessions, limits.cache_limit_bytes, limits.memory_limit_bytes) == (2, None, 512 * MB)
    assert (limits.max_video_bytes, limits.max_video_pixels) == (16 * MB, 20_000_000)
    assert (limits.max_image_bytes, limits.idle_s, args.queue_size) == (int(2.5 * MB), 30.0, 8)
    for bad in (["--max-sessions", "0"], ["--cache-limit-mb", "lots"], ["--max-prompt-tokens", "-5"]):
        with pytest.raises(SystemExit):
            app.parse_args(bad)


def test_main_launches_with_the_limits(monkeypatch):
    import gradio as gr

    import app

    for name in LIMIT_VARS:
        monkeypatch.delenv(name, raising=False)
    seen = {}
    monkeypatch.setattr(gr.Blocks, "launch", lambda self, **kwargs: seen.update(kwargs, blocks=self))
    assert app.main(["--model", "tiny-llama", "--max-image-mb", "2", "--max-sessions", "3", "--queue-size", "5",
                     "--memory-limit-mb", "off", "--max-video-mb", "1"]) == 0
    demo = seen["blocks"]
    assert seen["max_file_size"] == "2mb" and demo.limits.max_image_bytes == 2 * MB  # the larger file limit
    assert demo.limits.max_video_bytes == 1 * MB
    assert demo.controller.registry.limits.max_sessions == 3 and demo.limits.memory_limit_bytes is None
    assert demo._queue.max_size == 5
    (middleware,) = seen["app_kwargs"]["middleware"]
    assert middleware.kwargs["max_bytes"] == 2 * MB * 4 // 3 + 1 + MB  # one image as base64 text, and the rest
    assert middleware.kwargs["upload_max_bytes"] == 16 * 2 * MB + MB  # the upload route: a selection of images
    demo.controller.registry.close()


def test_example_images_order(tmp_path):
    """Photographs lead for real models; the embedded model, trained on the rendered scenes only, gets those
    first. Nothing but image files is offered."""
    from ui.inputs import example_images

    for name in ("scene-0.png", "cat.jpg", "scene-1.png", "notes.json", "bird.png"):
        (tmp_path / name).write_bytes(b"x")
    names = lambda paths: [Path(p).name for p in paths]  # noqa: E731
    assert names(example_images(tmp_path)) == ["bird.png", "cat.jpg", "scene-0.png", "scene-1.png"]
    assert names(example_images(tmp_path, scenes_first=True)) == ["scene-0.png", "scene-1.png", "bird.png", "cat.jpg"]
    assert example_images(tmp_path / "missing") == []
