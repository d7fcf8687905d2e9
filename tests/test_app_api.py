"""The app launched in-process on a free localhost port with a tiny model, driven through gradio_client."""
import threading

import pytest

from prefixkv_core import METHODS, Engine


@pytest.fixture(scope="module")
def url(tiny_llama, serve_app):
    return serve_app(Engine(tiny_llama), max_new_tokens_limit=32)


@pytest.fixture
def image_file(tmp_path, noise_image):
    path = tmp_path / "noise.png"
    noise_image.save(path)
    return str(path)


def test_compare_streams_results_for_several_methods(url, image_file, api_client):
    from gradio_client import handle_file

    client = api_client(url)
    api = client.view_api(return_format="dict", print_info=False)["named_endpoints"]["/compare"]
    names = [p["parameter_name"] for p in api["parameters"]]
    assert names[:5] == ["image", "prompt", "methods", "budget", "max_new_tokens"]
    assert "prefixkv__mode" in names and "zipvl__tau" in names

    job = client.submit(handle_file(image_file), "Describe the picture.", ["full", "h2o", "prefixkv"], 0.3, 12,
                        api_name="/compare")
    final = job.result()
    updates = job.outputs()
    assert len(updates) >= 2  # streamed: a first render, then updates, then the final state
    results = final[-1]
    assert set(results["methods"]) == {"full", "h2o", "prefixkv"} and results["finished"]
    for name, r in results["methods"].items():
        assert r["status"] == "done" and r["tokens"] >= 1 and len(r["kept_per_layer"]) == 4
        assert r["kv_bytes"] > 0 and r["ttft_s"] > 0
    assert results["methods"]["full"]["kv_ratio"] == pytest.approx(1.0)
    assert results["methods"]["h2o"]["kv_ratio"] < 0.6 and results["methods"]["prefixkv"]["kv_ratio"] < 0.6
    assert results["methods"]["h2o"]["rouge_l_vs_full"] is not None
    assert results["prefill"]["image_tokens"] == 16
    assert "Done" in final[0]
    # the panels: header HTML with badges, chat with the prompt and the answer
    heads = dict(zip(METHODS, final[1:1 + len(METHODS)]))  # one header per offered method, registry order
    assert "of full" in heads["prefixkv"] and "ms/token" in heads["prefixkv"]  # its own policy time
    assert "tok/s" not in heads["prefixkv"] and results["methods"]["prefixkv"]["alone"] is None
    assert results["timing"]["batch"]["methods"] == 3  # the shared forward, once

    # the same comparison with every method also timed alone
    assert "time_alone" in names
    final = client.predict(handle_file(image_file), "Describe the picture.", ["full", "h2o"], 0.3, 6,
                           time_alone=True, api_name="/compare")
    timed = final[-1]
    assert timed["timing"]["alone"] and timed["methods"]["full"]["speedup_vs_full"] == 1.0
    assert timed["methods"]["h2o"]["alone"]["same_answer"] is True and timed["methods"]["h2o"]["speedup_vs_full"] > 0
    heads = dict(zip(METHODS, final[1:1 + len(METHODS)]))
    assert "tok/s" in heads["h2o"] and "× Full" in heads["h2o"] and "TTFT alone" in heads["h2o"]

    follow = client.predict("And the colours?", api_name="/follow_up")
    assert follow[-1]["prompts"] == ["Describe the picture.", "And the colours?"]
    assert all(len(r["answers"]) == 2 for r in follow[-1]["methods"].values())


def test_bad_input_gives_messages_and_the_app_keeps_serving(url, tmp_path, api_client):
    from gradio_client import handle_file

    client = api_client(url)
    bad = tmp_path / "not-an-image.png"
    bad.write_text("hello")
    cases = [((None, "   ", ["full"], 0.3, 4), "prompt is empty"),
             ((None, "hi", [], 0.3, 4), "no method selected"),
             ((handle_file(str(bad)), "hi", ["full"], 0.3, 4), "not a readable image")]
    for args, message in cases:
        with pytest.raises(Exception, match=message):
            client.predict(*args, api_name="/compare")
    with pytest.raises(Exception, match="calibrated PrefixKV"):
        client.predict(None, "hi", ["prefixkv"], 0.3, 4, prefixkv__mode="offline", api_name="/compare")
    out = client.predict(None, "hello there", ["zipvl", "lookm"], 0.4, 3, zipvl__tau=0.9, lookm__merge="average",
                         api_name="/compare")
    assert out[-1]["knobs"] == {"lookm": {"merge": "average"}, "zipvl": {"tau": 0.9}}
    assert {r["status"] for r in out[-1]["methods"].values()} == {"done"}


def test_two_users_are_served_one_after_the_other(url, api_client):
    a, b = api_client(url), api_client(url)
    job_a = a.submit(None, "first user", ["full", "snapkv"], 0.3, 24, api_name="/compare")
    job_b = b.submit(None, "second user", ["full", "snapkv"], 0.3, 4, api_name="/compare")
    results = {}

    def wait(name, job):
        results[name] = job.result(timeout=120)

    threads = [threading.Thread(target=wait, args=(n, j)) for n, j in (("a", job_a), ("b", job_b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(150)
    assert results["a"][-1]["prompts"] == ["first user"] and results["b"][-1]["prompts"] == ["second user"]
    assert results["a"][-1]["finished"] and results["b"][-1]["finished"]


def test_several_images_and_a_video_through_the_api(url, image_file, api_client, tmp_path):
    """The gallery's images after the image, then a video's frames: one comparison over all of them, the overlay
    drawing each, the record naming each one's kept share; a follow-up stays text-only."""
    from gradio_client import handle_file

    from ui.visual_panel import MULTI_ASSETS, VIDEO_ASSETS

    client = api_client(url)
    names = [p["parameter_name"] for p in
             client.view_api(return_format="dict", print_info=False)["named_endpoints"]["/compare"]["parameters"]]
    assert {"images", "video", "frames"} <= set(names)
    sets = sorted(MULTI_ASSETS.glob("*.png"))[:3]
    final = client.predict(handle_file(image_file), "Which image shows a green cross?", ["full", "h2o"], 0.3, 4,
                           images=[{"image": handle_file(str(p))} for p in sets], api_name="/compare")
    results = final[-1]
    assert results["finished"] and results["prefill"]["image_tokens"] == 16 * 4
    assert len(results["visuals"]["images"]) == 4 and "video" not in results["visuals"]
    assert len(results["methods"]["h2o"]["kept_per_image"]) == 4
    gallery = final[1 + 2 * len(METHODS) + 5]
    assert len(gallery) == 2 and "image 4" in gallery[1]["caption"]
    follow = client.predict("And the second one?", api_name="/follow_up")
    assert follow[-1]["prompts"][-1] == "And the second one?"

    clip = VIDEO_ASSETS / "clip-0.mp4"
    final = client.predict(None, "What shape appears last?", ["full", "snapkv"], 0.3, 3, video=handle_file(str(clip)),
                           frames=5, api_name="/compare")
    results = final[-1]
    assert results["finished"] and results["visuals"]["video"]["frames"] == 5
    assert results["prefill"]["image_tokens"] == 16 * 5 and len(results["methods"]["snapkv"]["kept_per_image"]) == 5
    caption = final[1 + 2 * len(METHODS) + 5][0]["caption"]
    assert "frames 0.0 s" in caption

    # a corrupt video: a message, and the app keeps serving
    bad = tmp_path / "broken.mp4"
    bad.write_bytes(clip.read_bytes()[:1500])
    with pytest.raises(Exception, match="video: not a readable video"):
        client.predict(None, "hi", ["full"], 0.3, 2, video=handle_file(str(bad)), api_name="/compare")
    assert client.predict(None, "hello", ["full"], 0.3, 2, api_name="/compare")[-1]["finished"]
