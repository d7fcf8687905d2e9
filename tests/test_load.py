"""Bounded load on loopback: many clients in a row, every third one leaving mid-run, and one steady user
asking the same question alongside. The caches held stay under max_sessions comparisons, everything is
released once the clients are gone, resident memory returns to a steady level, and the steady user's
answers are the same every time.

Also a script for measuring a real model (numbers in docs/security.md):

    .venv/bin/python tests/test_load.py --model embedded --sessions 8 --prompt-words 600
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
import time

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

MB = 2**20


def _rss() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


def _answers(out) -> dict[str, list[str]]:
    return {m: r["answers"] for m, r in out[-1]["methods"].items()}


def churn(url: str, ctl, *, sessions: int, prompt: str, methods: list[str], max_new: int, abandon_every: int = 3,
          image=None, on_step=None, keep_open: bool = False) -> dict:
    """`sessions` clients one after the other; every `abandon_every`-th submits a longer run and closes its
    connection once tokens stream. The others close when done, or (`keep_open`) stay connected until the
    end. Returns what was measured after each client."""
    from gradio_client import Client

    from prefixkv_core.testing import wait_until

    steps, still_open = [], []
    for i in range(sessions):
        client = Client(url, verbose=False, download_files=False, httpx_kwargs={"timeout": 60})
        abandon = abandon_every and (i + 1) % abandon_every == 0
        if abandon:
            job = client.submit(image, f"{prompt} ({i})", methods, 0.3, max_new * 8, api_name="/compare")
            wait_until(lambda: len(job.outputs()) >= 2 or job.done(), timeout=120)
        else:
            out = client.predict(image, f"{prompt} ({i})", methods, 0.3, max_new, api_name="/compare")
            assert out[-1]["finished"], out[0]
        if keep_open and not abandon:
            still_open.append(client)
        else:
            client.close()
        registry = getattr(ctl, "registry", None)
        step = {"session": i + 1, "abandoned": bool(abandon), "rss": _rss(),
                "held": registry.held_bytes() if registry else None, "count": registry.count() if registry else None}
        steps.append(step)
        if on_step:
            on_step(step)
    for client in still_open:
        client.close()
    return {"steps": steps}


@pytest.fixture(scope="module")
def loaded_server(tiny_llama, serve_app):
    from prefixkv_core import Engine
    from prefixkv_core.limits import Limits

    limits = Limits(max_sessions=3, cache_limit_bytes=None, memory_limit_bytes=None)
    url = serve_app(Engine(tiny_llama), max_new_tokens_limit=64, limits=limits)
    return url, serve_app.demos[-1].controller, limits


def test_many_sessions_in_a_row_keep_memory_bounded_and_answers_intact(loaded_server, monkeypatch):
    from gradio_client import Client

    from prefixkv_core.limits import kv_bytes_per_token
    from prefixkv_core.testing import wait_until

    monkeypatch.setenv("GRADIO_HEARTBEAT_INTERVAL", "0.2")  # disconnects noticed within a fraction of a second
    url, ctl, limits = loaded_server
    methods = ["full", "snapkv"]
    steady = Client(url, verbose=False, download_files=False, httpx_kwargs={"timeout": 60})
    question = (None, "What is the steady user asking?", methods, 0.3, 4)
    reference = _answers(steady.predict(*question, api_name="/compare"))
    rss_start = _rss()

    # the most any comparison here can hold: every method's full cache at the longest run
    longest = 64 + 6 * 8 + 8  # prompt with template, the abandoned runs' new tokens, slack
    bound = kv_bytes_per_token(ctl.loaded) * longest * len(methods) * limits.max_sessions
    seen, steady_results, errors = [], [], []
    stop = threading.Event()

    def steady_user():
        try:
            while not stop.is_set() and len(steady_results) < 3:
                steady_results.append(_answers(steady.predict(*question, api_name="/compare")))
        except Exception as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    thread = threading.Thread(target=steady_user, daemon=True)
    thread.start()
    try:
        churn(url, ctl, sessions=9, prompt="Describe the picture", methods=methods, max_new=6,
              on_step=lambda step: seen.append((step["count"], step["held"])))
    finally:
        stop.set()
        thread.join(120)
    assert not errors and len(steady_results) >= 1
    assert all(result == reference for result in steady_results)  # other users' runs never changed its answers
    assert all(count <= limits.max_sessions for count, _ in seen)
    assert all(held <= bound for _, held in seen)

    steady.close()
    assert wait_until(lambda: ctl.registry.count() == 0 and ctl.registry.held_bytes() == 0, timeout=20)
    # a cancelled run stops at its next token, so the engine may be busy a moment after its session is gone
    assert wait_until(lambda: not ctl.engine.lock.locked(), timeout=20)
    # 10 clients came and went: what stays is bounded (their gradio state, not model caches)
    assert _rss() - rss_start < 150 * MB


# -- measuring a real model ----------------------------------------------------------------------------------

def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Memory of the app under a stream of sessions (loopback).")
    p.add_argument("--model", default="embedded")
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--prompt-words", type=int, default=600)
    p.add_argument("--methods", default="all")
    p.add_argument("--max-new", type=int, default=16)
    p.add_argument("--abandon-every", type=int, default=3)
    p.add_argument("--max-sessions", type=int, default=6)
    p.add_argument("--keep-open", action="store_true", help="clients stay connected until the end")
    args = p.parse_args(argv)
    os.environ.setdefault("GRADIO_HEARTBEAT_INTERVAL", "0.5")
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

    import socket

    from prefixkv_core import Engine, load_model, resolve_methods
    from ui.app_builder import build_app, launch_kwargs

    loaded = load_model(args.model)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    kwargs = {}
    try:
        from prefixkv_core.limits import Limits

        kwargs["limits"] = Limits(max_sessions=args.max_sessions, max_prompt_tokens=4096, max_run_tokens=8192)
    except ImportError:  # a version of the app without limits: measured as it is
        pass
    demo = build_app(Engine(loaded), max_new_tokens_limit=max(args.max_new * 8, 64), **kwargs)
    launch = launch_kwargs("127.0.0.1", port, prevent_thread_lock=True, quiet=True)
    if "limits" in kwargs:
        launch = launch_kwargs("127.0.0.1", port, limits=kwargs["limits"], prevent_thread_lock=True, quiet=True)
    demo.launch(**launch)
    url = f"http://127.0.0.1:{port}/"
    words = ("the small red house by the river has two green windows and a wooden door " * 200).split()
    prompt = " ".join(words[: args.prompt_words])
    methods = resolve_methods(args.methods)
    ctl = demo.controller
    print(f"model {loaded.name} ({loaded.dtype}), {len(methods)} methods, prompt {args.prompt_words} words, "
          f"{args.sessions} sessions (every {args.abandon_every}th leaves mid-run; the others "
          f"{'stay connected to the end' if args.keep_open else 'leave when done'})")
    print(f"start: RSS {_rss() / MB:.0f} MB")
    t0 = time.perf_counter()

    def show(step):
        held = "-" if step["held"] is None else f"{step['held'] / MB:.0f}"
        print(f"after session {step['session']:2d}{' (left mid-run)' if step['abandoned'] else '':15s} "
              f"RSS {step['rss'] / MB:6.0f} MB   caches held {held:>5s} MB in {step['count']} comparisons")

    churn(url, ctl, sessions=args.sessions, prompt=prompt, methods=methods, max_new=args.max_new,
          abandon_every=args.abandon_every, on_step=show, keep_open=args.keep_open)
    time.sleep(3)
    registry = getattr(ctl, "registry", None)
    print(f"all clients gone (+3 s): RSS {_rss() / MB:.0f} MB, caches held "
          f"{'-' if registry is None else f'{registry.held_bytes() / MB:.0f}'} MB; {time.perf_counter() - t0:.0f} s")
    demo.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
