"""The app's several images and video: the overlay over every image and a strip of frames (one image drawn as
before), the example sets read from their sidecars, the video checks at the boundary (confined, bytes and frame
pixels before decoding), the upload route's own body limit, and bad input that leaves the last comparison as it
was."""
import asyncio
import json
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from prefixkv_core import Engine, EngineError
from prefixkv_core.limits import MB, Limits
from prefixkv_core.models.layout import GridView, ImageLayout, join_layouts
from prefixkv_core.report.events import KeptImageMap
from prefixkv_core.session.video_input import VIDEO_REFUSED

ASSETS = Path(__file__).resolve().parent.parent / "assets"
CLIP = ASSETS / "videos" / "clip-0.mp4"


def _picture(rgb, size=(64, 48)):
    return Image.new("RGB", size, rgb)


def _several(n_images: int, n_frames: int, share_of=lambda i: 1.0):
    """A map over n_images + n_frames pictures of a 4x4 grid each, every token of picture i held by share_of(i)."""
    from ui.runstate import ShownVisuals

    count = n_images + n_frames
    layout = join_layouts([ImageLayout((GridView("image", 4, 4),), (64, 48)) for _ in range(count)])
    tokens = np.concatenate([np.full(16, share_of(i), dtype=np.float32) for i in range(count)])
    pictures = [_picture((200, 40 * i % 255, 30)) for i in range(count)]
    shown = ShownVisuals(pictures, ["image"] * n_images + ["frame"] * n_frames,
                         [None] * n_images + [0.5 * k for k in range(n_frames)])
    return shown, KeptImageMap(layout, tokens)


# -- the overlay -----------------------------------------------------------------------------------------------

def test_one_image_is_drawn_and_captioned_exactly_as_before():
    from ui.overlay import caption, overlay
    from ui.overlay_visuals import visuals_caption, visuals_overlay
    from ui.runstate import ShownVisuals

    image = _picture((10, 120, 200))
    kept = KeptImageMap(ImageLayout((GridView("image", 4, 4),), image.size), np.linspace(0, 1, 16, dtype=np.float32))
    shown = ShownVisuals([image], ["image"], [None])
    assert shown.single
    assert np.array_equal(np.asarray(visuals_overlay(shown, kept, "h2o")), np.asarray(overlay(image, kept, "h2o")))
    assert visuals_caption("H2O", kept, 3, shown) == caption("H2O", kept, 3)
    grid = np.ones((2, 2))
    assert visuals_caption("H2O", grid, 1, shown) == caption("H2O", grid, 1)


def test_the_overlay_reuses_an_images_backdrop_and_never_anothers():
    """Every method of a redraw is drawn over the same image: its resized, darkened views are made once and reused
    while that image lives; another image (even one of the same size, at a reused id) is drawn from its own."""
    from ui import overlay as overlay_module
    from ui.overlay import overlay

    layout = ImageLayout((GridView("image", 4, 4),), (64, 48))
    kept = KeptImageMap(layout, np.linspace(0, 1, 16, dtype=np.float32))
    red, blue = _picture((220, 30, 30)), _picture((30, 30, 220))
    first = np.asarray(overlay(red, kept, "h2o"))
    assert np.array_equal(np.asarray(overlay(red, kept, "h2o")), first)  # drawn again from the kept backdrop
    assert sum(entry[0]() is red for entry in overlay_module._VIEWS.values()) == 1
    other = np.asarray(overlay(blue, kept, "h2o"))
    assert not np.array_equal(other, first) and other[..., 2].mean() > other[..., 0].mean()
    # an image with two views (a tile over its top left quarter, then a thumbnail), each with its own backdrop
    two = ImageLayout((GridView("tile", 4, 4, box=(0.0, 0.0, 0.5, 0.5)), GridView("thumbnail", 4, 4)), (64, 48))
    both = KeptImageMap(two, np.linspace(0, 1, 32, dtype=np.float32))
    drawn = np.asarray(overlay(blue, both, "h2o"))
    assert np.array_equal(np.asarray(overlay(blue, both, "h2o")), drawn) and drawn.shape[1] > 2 * drawn.shape[0]
    del red
    for _ in range(overlay_module._VIEWS_KEPT + 2):  # the backdrops kept are bounded
        overlay(_picture((1, 2, 3)), kept, "")
    assert len(overlay_module._VIEWS) <= overlay_module._VIEWS_KEPT


def test_several_images_each_with_their_views_and_their_share():
    from ui.overlay_visuals import image_shares, visuals_caption, visuals_overlay

    shown, kept = _several(3, 0, share_of=lambda i: [1.0, 0.5, 0.0][i])
    assert image_shares(kept) == [1.0, 0.5, 0.0]
    out = visuals_overlay(shown, kept, "snapkv")
    assert out.height > 224 and out.width > 3 * 224  # three tiles side by side, each 224 high
    text = visuals_caption("SnapKV", kept, 2, shown)
    assert text.startswith("SnapKV · layer 2 · 32 of 48 image tokens kept · mean share 50%")
    assert "image 1 100% · image 2 50% · image 3 0%" in text and "frames" not in text
    arr = np.asarray(out, dtype=int)
    third = arr[20:300, out.width * 5 // 6]  # the evicted image is dark, the kept one keeps its colour
    first = arr[20:300, out.width // 6]
    assert third.mean() < first.mean()


def test_a_video_is_a_strip_of_small_frames_with_bars_filled_to_their_share():
    from ui.overlay_visuals import BAR, visuals_caption, visuals_overlay
    from ui.theme import colour

    shown, kept = _several(1, 6, share_of=lambda i: 1.0 if i == 0 else (i - 1) / 5)
    out = visuals_overlay(shown, kept, "h2o")
    text = visuals_caption("H2O", kept, 0, shown)
    assert "image 1 100%" in text and "frames 0.0 s 0% · 0.5 s 20% · 1.0 s 40%" in text and "2.5 s 100%" in text
    # second row: six frame tiles of 128 pixels; each bar is filled (in the method's colour) to its frame's share
    arr = np.asarray(out)
    h2o = np.array(Image.new("RGB", (1, 1), colour("h2o")).getpixel((0, 0)))
    bar_y = out.height - 6 - BAR // 2 - 6  # inside the last row's bars, below their text
    row = arr[bar_y]
    filled = (np.abs(row.astype(int) - h2o).sum(axis=1) < 30).sum()
    assert 128 * 2.5 < filled < 128 * 3.2  # 0 + 0.2 + 0.4 + 0.6 + 0.8 + 1.0 of a tile's width, give or take text
    many, kept_many = _several(0, 40)
    tall = visuals_overlay(many, kept_many, "h2o")
    assert tall.width <= 1344 + 20 and tall.height > 3 * 96  # 96-pixel frames, wrapped in rows


def test_a_view_without_patches_and_a_short_map_do_not_break_the_overlay():
    """A video read natively ends with a newline token that has no patch; a map over fewer pictures than shown
    draws what it covers."""
    from ui.overlay_visuals import visuals_overlay
    from ui.runstate import ShownVisuals

    views = (GridView("frame 1", 2, 2, image=0), GridView("frame 2", 2, 2, image=1),
             GridView("video newline", 1, 0, newline=True, image=1))
    kept = KeptImageMap(ImageLayout(views, (32, 32), ((32, 32), (32, 32))), np.ones(9, dtype=np.float32))
    shown = ShownVisuals([_picture((0, 200, 0))] * 2, ["frame", "frame"], [0.0, 1.0])
    assert visuals_overlay(shown, kept, "full").width > 2 * 128
    only_one = ShownVisuals([_picture((0, 0, 200))] * 3, ["image"] * 3, [None] * 3)
    assert visuals_overlay(only_one, kept, "").height > 0


# -- examples --------------------------------------------------------------------------------------------------

def test_example_sets_come_from_their_sidecars_or_their_names(tmp_path):
    from ui.visual_panel import MULTI_PROMPT, VIDEO_PROMPT, multi_examples, video_examples

    shipped = multi_examples()
    assert shipped and len(shipped[0][0]) >= 2 and all(Path(p).is_file() for p in shipped[0][0])
    sidecar = json.loads(next((ASSETS / "multi").glob("*.json")).read_text())
    assert shipped[0][1] == sidecar.get("prompt", sidecar.get("question"))
    clips = video_examples()
    assert clips and Path(clips[0][0]).name == "clip-0.mp4" and clips[0][1] == "What shape appears last?"

    for name in ("set-a-2.png", "set-a-1.png", "set-a-10.png", "set-b-1.png", "lone-1.png", "notes.txt"):
        _picture((1, 2, 3)).save(tmp_path / name) if name.endswith(".png") else (tmp_path / name).write_text("x")
    (tmp_path / "set-b-2.png").write_bytes((tmp_path / "set-b-1.png").read_bytes())
    (tmp_path / "broken.json").write_text("{not json")
    (tmp_path / "pair.json").write_text(json.dumps({"images": ["set-b-2.png", "set-b-1.png"], "question": "Same?"}))
    sets = [([Path(p).name for p in paths], prompt) for paths, prompt in multi_examples(tmp_path)]
    assert sets == [(["set-b-2.png", "set-b-1.png"], "Same?"),
                    (["set-a-1.png", "set-a-2.png", "set-a-10.png"], MULTI_PROMPT)]
    shutil.copy(CLIP, tmp_path / "a.mp4")
    shutil.copy(CLIP, tmp_path / "b.webm")
    (tmp_path / "a.json").write_text(json.dumps({"file": "a.mp4", "question": "What moves?"}))
    assert [(Path(p).name, q) for p, q in video_examples(tmp_path)] == [("a.mp4", "What moves?"), ("b.webm", VIDEO_PROMPT)]
    assert multi_examples(tmp_path / "missing") == [] and video_examples(tmp_path / "missing") == []


def test_the_page_offers_the_new_inputs_and_examples(tiny_llama):
    import gradio as gr

    from ui.app_builder import build_app

    demo = build_app(Engine(tiny_llama), max_new_tokens_limit=8,
                     limits=Limits(cache_limit_bytes=None, memory_limit_bytes=None))
    ids = {b.elem_id: b for b in demo.blocks.values() if getattr(b, "elem_id", None)}
    assert isinstance(ids["images-input"], gr.Gallery) and isinstance(ids["video-input"], gr.Video)
    frames = ids["frames"]
    assert (frames.minimum, frames.maximum, frames.value, frames.visible) == (1, 64, 8, False)
    sets = next(b for b in demo.blocks.values() if isinstance(b, gr.Dataset) and b.label.startswith("Several"))
    assert len(sets.samples[0][0]) >= 2  # a shipped set's images (the image's column, empty throughout, left out)
    clips = [row for row in sets.samples if row[1]]
    assert clips and clips[0][1]["orig_name"] == "clip-0.mp4" and clips[0][2] == "What shape appears last?"
    demo.controller.registry.close()


# -- the video at the boundary ---------------------------------------------------------------------------------

def test_video_files_are_confined_measured_and_probed_before_decoding(tmp_path):
    from ui.visual_inputs import check_video_file

    roots = [str(tmp_path / "uploads")]
    os.makedirs(roots[0])
    inside = Path(roots[0]) / "clip.mp4"
    shutil.copy(CLIP, inside)
    upload = check_video_file(str(inside), roots, MB)
    assert upload.size == (384, 384) and upload.bytes == CLIP.stat().st_size
    outside = tmp_path / "private.mp4"
    shutil.copy(CLIP, outside)
    link = Path(roots[0]) / "link.mp4"
    link.symlink_to(outside)
    os.mkfifo(Path(roots[0]) / "pipe.mp4")
    (Path(roots[0]) / "text.mp4").write_text("hello")
    os.mkdir(Path(roots[0]) / "folder.mp4")
    for bad in (outside, link, Path(roots[0]) / "pipe.mp4", Path(roots[0]) / "text.mp4", Path(roots[0]) / "folder.mp4",
                Path(roots[0]) / "missing.mp4", "/etc/passwd", "", None, 5, str(inside) + "\x00"):
        with pytest.raises(EngineError) as err:
            check_video_file(bad if not isinstance(bad, Path) else str(bad), roots, MB)
        assert str(err.value) == VIDEO_REFUSED
    noise = Path(roots[0]) / "noise.mp4"
    noise.write_bytes(os.urandom(3000))  # over the limit: refused for its size without being read as a video
    with pytest.raises(EngineError, match=r"the video is 0.0 MB; the limit is 0.00190735 MB: send a shorter"):
        check_video_file(str(noise), roots, 2000)
    with pytest.raises(EngineError, match=re.escape(VIDEO_REFUSED)):
        check_video_file(str(noise), roots, MB)


def test_frames_are_counted_and_bounded_by_their_pixels(tmp_path):
    from ui.visual_inputs import check_video_file, load_checked_video

    roots = [str(CLIP.parent)]
    limits = Limits(max_video_pixels=384 * 384 * 4)
    clip = load_checked_video(check_video_file(str(CLIP), roots, MB), 4, limits, roots)
    assert len(clip.frames) == 4 and clip.total_frames == 16 and clip.size == (384, 384)
    with pytest.raises(EngineError, match=r"5 frames of 384×384 pixels are 1 megapixels; the limit is 0.589824: "
                                          r"ask for at most 4 frames"):
        load_checked_video(str(CLIP), 5, limits, roots)
    for frames in (0, 65, 2.5, "8", True):
        with pytest.raises(EngineError, match="frames must be a whole number from 1 to 64"):
            load_checked_video(str(CLIP), frames, limits, roots)


def test_the_upload_route_has_its_own_body_limit():
    from ui.http_limits import BodySizeLimit, upload_limit_for

    assert upload_limit_for(10 * MB, 64 * MB) == 161 * MB and upload_limit_for(10 * MB, 300 * MB) == 301 * MB

    async def app(scope, receive, send):
        body = b""
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                await send({"type": "http.response.start", "status": 499, "headers": []})
                await send({"type": "http.response.body", "body": b""})
                return
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": str(len(body)).encode()})

    limit = BodySizeLimit(app, max_bytes=100, upload_max_bytes=1000)

    def call(path, size, chunked=False):
        headers = [] if chunked else [(b"content-length", str(size).encode())]
        scope = {"type": "http", "method": "POST", "path": path, "headers": headers}
        chunks = [{"type": "http.request", "body": b"x" * 100, "more_body": True} for _ in range(size // 100)]
        chunks.append({"type": "http.request", "body": b"", "more_body": False})
        sent = []

        async def receive():
            return chunks.pop(0)

        async def send(message):
            sent.append(message)

        asyncio.run(limit(scope, receive, send))
        return sent[0]["status"]

    assert call("/gradio_api/call/compare", 500) == 413  # an API call: the image body limit
    assert call("/gradio_api/upload", 500) == 200  # an upload: its own
    assert call("/gradio_api/upload", 1500) == 413
    assert call("/gradio_api/upload", 500, chunked=True) == 200
    assert call("/gradio_api/upload", 1500, chunked=True) == 499  # cut off as if the client had left


# -- bad input ---------------------------------------------------------------------------------------------------

def test_bad_visuals_are_refused_and_the_last_comparison_stays(tiny_llama, noise_image, tmp_path):
    import gradio as gr

    from ui.app_builder import build_app
    from ui.controller import SessionBox

    ctl = build_app(Engine(tiny_llama), max_new_tokens_limit=8,
                    limits=Limits(max_run_tokens=120, max_video_bytes=200_000, cache_limit_bytes=None,
                                  memory_limit_bytes=None)).controller
    box = SessionBox()
    list(ctl.compare(noise_image, "Describe.", ["full", "h2o"], 0.3, 3, box=box, images=[noise_image]))
    comp = box.run
    assert comp.to_dict()["finished"] and len(comp.shown.images) == 2
    corrupt = Path(ctl.image_roots()[0]) / f"corrupt-{os.getpid()}.mp4"
    corrupt.write_bytes(CLIP.read_bytes()[:1800])
    big = Path(ctl.image_roots()[0]) / f"big-{os.getpid()}.mp4"
    big.write_bytes(os.urandom(210_000))
    text = tmp_path / "notes.png"
    text.write_text("not an image")
    cases = [(dict(images=[noise_image, str(text)]), "image 3 of 3: not a readable image"),
             (dict(video=str(corrupt)), "video: not a readable video"),
             (dict(video=str(big)), r"video: the video is 0.2 MB; the limit is 0.190735 MB"),
             (dict(images=[noise_image] * 8), r"9 images take 144 tokens; with the text and 3 new tokens that is \d+, "
                                              r"over this run's limit of 120: at most \d of them fit"),
             (dict(video=str(CLIP), frames=7), r"1 image and 7 frames take .* at most \d of them fit"),
             (dict(video=str(CLIP), frames=0), "frames must be a whole number from 1 to 64, got 0"),
             (dict(video=str(CLIP), frames=99), "frames must be a whole number from 1 to 64, got 99"),
             (dict(images="abc"), "images must be a list of images")]
    try:
        for kwargs, message in cases:
            with pytest.raises(gr.Error, match=message):
                list(ctl.compare(noise_image, "Describe.", ["full"], 0.3, 3, box=box, **kwargs))
            assert box.run is comp and comp.session is not None and not box.pending  # nothing lost
    finally:
        corrupt.unlink()
        big.unlink()
    follow = list(ctl.follow_up("And then?", box))  # the conversation goes on, text only
    assert comp.to_dict()["prompts"] == ["Describe.", "And then?"] and follow
    ctl.registry.close()


def test_letting_go_of_a_comparison_drops_its_pictures():
    from prefixkv_core.policies import role_methods
    from prefixkv_core.report.record import ComparisonRecord
    from ui.run_stream import let_go
    from ui.runstate import Comparison, ShownVisuals

    comp = Comparison(ComparisonRecord(["full"], {"full": "Full"}, "Hi", 0.3, {"max_new_tokens": 2}, {},
                                       roles=role_methods()),
                      shown=ShownVisuals([_picture((1, 1, 1))] * 3, ["image", "frame", "frame"], [None, 0.0, 1.0]))
    assert comp.image is comp.shown.images[0]
    let_go(comp, "idle")
    assert comp.shown is not None
    let_go(comp, "closed")
    assert comp.shown is None and comp.image is None


def test_export_with_several_images_and_a_video(tiny_llama, noise_image):
    """The export path is unchanged: every chart, the overlays (one image per method, every picture in it) and the
    transcript, which names the visuals."""
    from ui.app_builder import build_app
    from ui.controller import SessionBox
    from ui.export import visuals_line

    ctl = build_app(Engine(tiny_llama), methods="full,h2o,prefixkv", max_new_tokens_limit=8,
                    limits=Limits(cache_limit_bytes=None, memory_limit_bytes=None)).controller
    box = SessionBox(overlay_layer=2)
    outs = list(ctl.compare(noise_image, "Compare them.", ["full", "h2o", "prefixkv"], 0.3, 3, box=box,
                            images=[noise_image, noise_image], video=str(CLIP), frames=4))
    final = dict(zip(ctl.output_keys, outs[-1]))
    assert "(112 image: 3 images, 4 frames)" in final["status"]
    results = final["results"]
    assert [len(results["methods"][m]["kept_per_image"]) for m in ("full", "h2o")] == [7, 7]
    assert results["methods"]["full"]["kept_per_image"] == [1.0] * 7
    assert len(final["gallery"]) == 3 and "frames 0.0 s" in final["gallery"][1][1]
    files, message = ctl.export(["html"], box)
    names = {Path(f).name for f in files["value"]}
    assert {"figures.html", "results.json", "results.csv", "table.tex", "transcript.md",
            "overlay-layer2-h2o.png"} <= names
    transcript = Path(next(f for f in files["value"] if f.endswith("transcript.md"))).read_text()
    assert "- visuals: 3 images (64×48, 64×48, 64×48); video clip-0.mp4, 4 of its 16 frames (0.0 to 3.8 s)" in transcript
    assert visuals_line({}) == ""
    overlay = Image.open(next(f for f in files["value"] if f.endswith("overlay-layer2-h2o.png")))
    assert overlay.width > 3 * 224  # the three images side by side, the frames under them
    ctl.registry.close()
    ctl.exports.close()


@pytest.mark.parametrize("family", ["llava-onevision", "llava-interleave"])
def test_the_run_limit_counts_every_image_and_frame_as_the_model_reads_them(family):
    """OneVision reads a video on its own path (pooled frames), the others as images: the app's count of a first
    turn is the prompt the engine then prefills, markers or none; the display copies follow the model's order."""
    from prefixkv_core import GenerationSettings
    from prefixkv_core.testing import build_tiny_family
    from ui.visual_request import check_first_turn, gather, shown

    lm = build_tiny_family(family)
    engine = Engine(lm)
    pictures = [Image.open(ASSETS / "multi" / f"multi-0-{i}.png") for i in (1, 2)]
    limits = Limits(max_run_tokens=100_000)
    placed = (("<image> then <video> then <image>?", 3, ["image"] + ["frame"] * 3 + ["image"])
              if family == "llava-onevision" else ("<image> and <image>, then <video>?", 3, ["image"] * 2 + ["frame"] * 3))
    for prompt, frames, kinds in (("Which?", 4, ["image"] * 2 + ["frame"] * 4), placed):
        visuals = gather(engine, pictures[0], pictures[1:], str(CLIP), frames, limits, [str(ASSETS)])
        session = engine.new_session(visuals.engine_images(), prompt, ["full"], 0.3,
                                     GenerationSettings(max_new_tokens=2), video=visuals.clip, frames=frames)
        predicted = check_first_turn(limits, lm, prompt, session.visuals, 2) - 2
        display = shown(session, visuals.clip)
        assert display.kinds == kinds and [t for t in display.times if t is not None] == list(visuals.clip.timestamps)
        list(session.run())
        assert predicted == session.prefill.prompt_tokens, (family, prompt)
        session.release()
