"""PrefixKV Lab: compare KV-cache compression methods on a LLaVA model, side by side, in the browser.

    python app.py                                   # embedded model (offline), http://127.0.0.1:7860
    python app.py --model llava-hf/llava-interleave-qwen-0.5b-hf
    python app.py --model llava-hf/llava-1.5-7b-hf --device cuda --dtype float16 --host 0.0.0.0

Every flag also reads an environment variable (PREFIXKV_MODEL, PREFIXKV_DEVICE, PREFIXKV_DTYPE,
PREFIXKV_HOST, PORT, PREFIXKV_METHODS, PREFIXKV_MAX_NEW_TOKENS_LIMIT, and the limits: PREFIXKV_MAX_PROMPT_CHARS,
PREFIXKV_MAX_PROMPT_TOKENS, PREFIXKV_MAX_RUN_TOKENS, PREFIXKV_MAX_IMAGE_MB, PREFIXKV_MAX_IMAGE_MEGAPIXELS,
PREFIXKV_MAX_VIDEO_MB, PREFIXKV_MAX_VIDEO_MEGAPIXELS, PREFIXKV_MAX_VIDEO_DECODE_SECONDS, PREFIXKV_MAX_SESSIONS, PREFIXKV_SESSION_IDLE_MINUTES, PREFIXKV_CACHE_LIMIT_MB, PREFIXKV_MEMORY_LIMIT_MB,
PREFIXKV_QUEUE_SIZE, PREFIXKV_ENGINE_PROCESS, PREFIXKV_SERVER_NICE), which is how the Docker image / a Hugging Face
Space sets them. No share link is ever opened.

The model runs in a process of its own (`--no-engine-process` keeps it in the server's): the server's Python work for
several visitors (their redraws, the updates it sends) then never holds the interpreter the model's thread needs,
and the server lowers its own priority (`--server-nice`) so that on a few cores the model comes first.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _env(name: str, default: str) -> str:
    return os.environ.get(name) or default


def _megabytes_or_auto(text: str) -> str:
    """'auto', 'off' (or 0) or a positive number of megabytes."""
    value = str(text).strip().lower()
    if value in ("auto", "off", "0", "none"):
        return "off" if value in ("off", "0", "none") else "auto"
    try:
        if float(value) > 0:
            return value
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"expected 'auto', 'off' or a positive number of megabytes, got {text!r}")


def _positive(kind):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a positive {kind.__name__}, got {text!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"expected a positive {kind.__name__}, got {text!r}")
        return value

    return parse


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from prefixkv_core.method_args import add_model_args

    p = argparse.ArgumentParser(prog="app.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    add_model_args(p, default_model=_env("PREFIXKV_MODEL", "embedded"), default_device=_env("PREFIXKV_DEVICE", "auto"),
                   default_dtype=_env("PREFIXKV_DTYPE", "auto"))
    p.add_argument("--host", default=_env("PREFIXKV_HOST", "127.0.0.1"),
                   help="address to listen on (default 127.0.0.1; 0.0.0.0 in Docker)")
    p.add_argument("--port", type=int, default=int(_env("PORT", "7860")), help="port (default 7860)")
    p.add_argument("--methods", default=_env("PREFIXKV_METHODS", "all"),
                   help="methods offered, 'all' or a comma list, e.g. full,snapkv,prefixkv")
    p.add_argument("--max-new-tokens-limit", type=int, default=int(_env("PREFIXKV_MAX_NEW_TOKENS_LIMIT", "256")),
                   help="upper end of the max-new-tokens slider (default 256)")
    p.add_argument("--engine-process", action=argparse.BooleanOptionalAction,
                   default=_env("PREFIXKV_ENGINE_PROCESS", "1").lower() not in ("0", "false", "no", "off"),
                   help="run the model in a process of its own (default on; --no-engine-process: in the server's)")
    p.add_argument("--server-nice", type=int, default=int(_env("PREFIXKV_SERVER_NICE", "10")),
                   help="with the engine in its own process, lower the server's priority by this much (0-19; "
                        "default 10): the model's process comes first on the cores")
    g = p.add_argument_group("limits (what one client may ask, what all of them may hold)")
    g.add_argument("--max-prompt-chars", type=_positive(int), default=_env("PREFIXKV_MAX_PROMPT_CHARS", "2000"),
                   help="characters in a prompt or follow-up question (default 2000)")
    g.add_argument("--max-prompt-tokens", type=_positive(int), default=_env("PREFIXKV_MAX_PROMPT_TOKENS", "1024"),
                   help="tokens in a prompt or follow-up question (default 1024)")
    g.add_argument("--max-run-tokens", type=_positive(int), default=_env("PREFIXKV_MAX_RUN_TOKENS", "3072"),
                   help="tokens a whole conversation may reach: template, image, turns and answers (default 3072)")
    g.add_argument("--max-image-mb", type=_positive(float), default=_env("PREFIXKV_MAX_IMAGE_MB", "10"),
                   help="image size however it arrives: upload, data URL or API file (default 10)")
    g.add_argument("--max-image-megapixels", type=_positive(float),
                   default=_env("PREFIXKV_MAX_IMAGE_MEGAPIXELS", "40"), help="decoded image size (default 40)")
    g.add_argument("--max-video-mb", type=_positive(float), default=_env("PREFIXKV_MAX_VIDEO_MB", "64"),
                   help="video file size, uploads only (default 64)")
    g.add_argument("--max-video-megapixels", type=_positive(float),
                   default=_env("PREFIXKV_MAX_VIDEO_MEGAPIXELS", "100"),
                   help="a video's sampled frames together, frames x width x height, read from its header before "
                        "decoding and checked again as they decode (default 100)")
    g.add_argument("--max-video-decode-seconds", type=_positive(float),
                   default=_env("PREFIXKV_MAX_VIDEO_DECODE_SECONDS", "20"),
                   help="the decoder's time for one video; the frames it must go through are also bounded before "
                        "it starts (default 20)")
    g.add_argument("--max-sessions", type=_positive(int), default=_env("PREFIXKV_MAX_SESSIONS", "6"),
                   help="conversations that keep their KV caches for follow-ups; least recently used dropped "
                        "first (default 6)")
    g.add_argument("--session-idle-minutes", type=_positive(float),
                   default=_env("PREFIXKV_SESSION_IDLE_MINUTES", "10"),
                   help="drop a conversation's caches after this long unused (default 10)")
    g.add_argument("--cache-limit-mb", type=_megabytes_or_auto, default=_env("PREFIXKV_CACHE_LIMIT_MB", "auto"),
                   help="KV caches of all conversations plus the next run; 'auto' (default): half the free GPU "
                        "memory after loading, or a quarter of the machine's memory on CPU; 'off'")
    g.add_argument("--memory-limit-mb", type=_megabytes_or_auto, default=_env("PREFIXKV_MEMORY_LIMIT_MB", "auto"),
                   help="refuse new runs while the process uses more; 'auto' (default): 90%% of the machine's or "
                        "container's memory; 'off'")
    g.add_argument("--max-batch-users", type=_positive(int), default=_env("PREFIXKV_MAX_BATCH_USERS", "4"),
                   help="users whose runs go at once, their methods decoded together in one batch; more wait in "
                        "the queue (default 4)")
    g.add_argument("--queue-size", type=_positive(int), default=_env("PREFIXKV_QUEUE_SIZE", "64"),
                   help="requests that may wait for the model (default 64)")
    return p.parse_args(argv)


def build_limits(args: argparse.Namespace, loaded):
    """The Limits for this server from the flags ('auto' ceilings are measured on this machine)."""
    from prefixkv_core.limits import MB, Limits, default_cache_limit, default_memory_limit

    def ceiling(value: str, auto):
        return None if value == "off" else auto() if value == "auto" else int(float(value) * MB)

    return Limits(max_prompt_chars=args.max_prompt_chars, max_prompt_tokens=args.max_prompt_tokens,
                  max_run_tokens=args.max_run_tokens, max_image_bytes=int(args.max_image_mb * MB),
                  max_image_pixels=int(args.max_image_megapixels * 1e6), max_video_bytes=int(args.max_video_mb * MB),
                  max_video_pixels=int(args.max_video_megapixels * 1e6),
                  max_video_decode_s=args.max_video_decode_seconds, max_sessions=args.max_sessions,
                  idle_s=args.session_idle_minutes * 60, max_batch_users=args.max_batch_users,
                  cache_limit_bytes=ceiling(args.cache_limit_mb, lambda: default_cache_limit(loaded)),
                  memory_limit_bytes=ceiling(args.memory_limit_mb, default_memory_limit))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("app")

    from prefixkv_core import Engine, EngineProcess, ModelLoadError, PolicyError, load_model, resolve_methods

    try:
        methods = resolve_methods(args.methods)
    except PolicyError as exc:
        print(f"app.py: --methods: {exc}", file=sys.stderr)
        return 2
    if args.max_new_tokens_limit < 1:
        print("app.py: --max-new-tokens-limit must be at least 1", file=sys.stderr)
        return 2
    if not 0 <= args.server_nice <= 19:
        print("app.py: --server-nice must be from 0 to 19", file=sys.stderr)
        return 2

    log.info("loading model %r (device=%s, dtype=%s)…", args.model, args.device, args.dtype)
    t0 = time.perf_counter()
    try:
        if args.engine_process:
            engine = EngineProcess(args.model, device=args.device, dtype=args.dtype)
        else:
            engine = Engine(load_model(args.model, device=args.device, dtype=args.dtype))
    except ModelLoadError as exc:
        print(f"app.py: cannot load model {args.model!r}: {exc}", file=sys.stderr)
        return 1
    loaded = engine.loaded
    log.info("loaded %s on %s (%s) in %.1f s%s", loaded.name, loaded.device, loaded.dtype, time.perf_counter() - t0,
             " in a process of its own" if args.engine_process else "")
    if args.engine_process and args.server_nice:
        os.nice(args.server_nice)  # this process only: the engine's was started before
    for note in loaded.notes:
        log.info("model note: %s", note)

    from ui.app_builder import build_app, hand_the_interpreter_back_sooner, launch_kwargs

    limits = build_limits(args, loaded)
    log.info("limits: prompt %d characters / %d tokens, conversation %d tokens, image %s, video %s, %d "
             "conversations holding caches (idle %.0f min), cache limit %s, memory limit %s, %d users decoded at once",
             limits.max_prompt_chars, limits.max_prompt_tokens, limits.max_run_tokens, limits.image_limit_text,
             f"{limits.max_video_bytes / 2**20:g} MB and {limits.max_video_pixels / 1e6:g} megapixels of frames",
             limits.max_sessions, limits.idle_s / 60, _mb(limits.cache_limit_bytes), _mb(limits.memory_limit_bytes),
             limits.max_batch_users)
    demo = build_app(engine, methods=methods, max_new_tokens_limit=args.max_new_tokens_limit, limits=limits,
                     queue_size=args.queue_size)
    hand_the_interpreter_back_sooner()
    demo.launch(**launch_kwargs(args.host, args.port, limits=limits))
    return 0


def _mb(value: int | None) -> str:
    return "off" if value is None else f"{value / 2**20:.0f} MB"


if __name__ == "__main__":
    sys.exit(main())
