import os

# No network in tests, no analytics.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["GRADIO_ANALYTICS_ENABLED"] = "False"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np
import pytest
import torch
from PIL import Image

from prefixkv_core.testing import LLAVA_FAMILIES

if os.environ.get("PYTEST_XDIST_WORKER"):
    # the suite runs in one worker per core (pytest.ini): one torch thread each, so that the workers do not
    # spin-wait on each other's cores
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_llama():
    from prefixkv_core.testing import build_tiny_model

    return build_tiny_model("llama", seed=0)


@pytest.fixture(scope="session")
def tiny_qwen2():
    from prefixkv_core.testing import build_tiny_model

    return build_tiny_model("qwen2", seed=0)


@pytest.fixture(params=["llama", "qwen2"])
def tiny(request, tiny_llama, tiny_qwen2):
    """Both tiny architectures: MHA (llama) and GQA (qwen2)."""
    return tiny_llama if request.param == "llama" else tiny_qwen2


@pytest.fixture(scope="module")
def family_models():
    """family -> a tiny random model of that LLaVA family, built in memory."""
    from prefixkv_core.testing import build_tiny_family

    return {family: build_tiny_family(family) for family in LLAVA_FAMILIES}


@pytest.fixture(params=LLAVA_FAMILIES)
def lm(request, family_models):
    """Each LLaVA family's tiny model in turn (1.5, Interleave, NeXT with anyres, OneVision)."""
    return family_models[request.param]


@pytest.fixture(scope="module")
def picture():
    """A wide noise image (`testing.WIDE_PICTURE_SIZE`) for the every-family tests."""
    from prefixkv_core.testing import wide_noise_picture

    return wide_noise_picture()


@pytest.fixture(scope="session")
def noise_image():
    rng = np.random.RandomState(0)
    return Image.fromarray((rng.rand(48, 64, 3) * 255).astype("uint8"))


@pytest.fixture(scope="session")
def api_client():
    """Opens a `gradio_client.Client` on an app's URL. Its HTTP timeout is patient (60 s, not httpx's 5 s): a busy
    two-core machine can take longer than 5 s to answer the first request."""
    from gradio_client import Client

    def open_client(url: str) -> Client:
        return Client(url, verbose=False, download_files=False, httpx_kwargs={"timeout": 60})

    return open_client


@pytest.fixture(scope="module")
def serve_app():
    """Launch build_app(engine, **kwargs) on a free local port; returns its URL; closed with the module."""
    from ui.app_builder import serve_locally

    demos = []

    def start(engine, **kwargs) -> str:
        demo, url = serve_locally(engine, **kwargs)
        demos.append(demo)
        return url

    start.demos = demos  # the launched Blocks, for tests that look at the server's side (demo.controller)
    yield start
    for demo in demos:
        try:
            demo.close()
        except RuntimeError:  # Blocks.close sets the app's asyncio stop event from this thread while the server's
            # loop may be iterating its waiters ("deque mutated during iteration"); what close skipped then:
            if demo.server:
                demo.server.close()


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models on a shared 2-core machine: one torch thread avoids OpenMP spin-waiting (10x faster)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def threads_restored():
    """The benchmarks set torch's thread count (--threads 1); put it back for the other tests."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def decodes_at_the_true_length():
    """check(loaded, image, prompt, method): AssertionError unless a session's compressed `method` feeds each new token
    at its true position (the prompt's length plus the tokens before it), not at the number of entries its cache
    holds. The reference is the benchmarks' batch runner (`benchmarks/batched.py`), which feeds at the true length."""
    from benchmarks.batched import MethodRun
    from prefixkv_core import Engine, GenerationSettings
    from prefixkv_core import models as M
    from prefixkv_core.kv.attention import tracked_attention_enabled
    from prefixkv_core.policies import make_policy

    def check(loaded, image, prompt: str, method: str, budget: float = 0.3) -> None:
        session = Engine(loaded).new_session(image, prompt, [method], budget, GenerationSettings(max_new_tokens=6))
        list(session.run())
        state = session.states[method]
        assert state.cache.layers[0].length < state.true_len, "the cache holds every entry: the check proves nothing"
        inputs = M.encode(loaded, image, M.format_prompt(loaded, prompt, with_image=True))
        ids = inputs["input_ids"]
        run = MethodRun(loaded, make_policy(method, budget), budget)
        with tracked_attention_enabled(loaded.model), torch.inference_mode():
            token = run.prefill(ids, loaded.visual_mask(ids), M.vision_inputs(inputs))
            want = [int(token)]
            while len(want) < len(state.turn_ids):
                token = run.step(token)
                want.append(int(token))
        assert state.turn_ids == want, (method, state.turn_ids, want)

    return check
