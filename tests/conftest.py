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
        demo.close()


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
