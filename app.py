"""PrefixKV Lab: compare KV-cache compression methods on a LLaVA model, side by side, in the browser.

    python app.py                                   # embedded model (offline), http://127.0.0.1:7860
    python app.py --model llava-hf/llava-interleave-qwen-0.5b-hf
    python app.py --model llava-hf/llava-1.5-7b-hf --device cuda --dtype float16 --host 0.0.0.0

Every flag also reads an environment variable (PREFIXKV_MODEL, PREFIXKV_DEVICE, PREFIXKV_DTYPE,
PREFIXKV_HOST, PORT, PREFIXKV_METHODS, PREFIXKV_MAX_NEW_TOKENS_LIMIT), which is how the Docker image / a
Hugging Face Space sets them. No share link is ever opened.
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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="app.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--model", default=_env("PREFIXKV_MODEL", "embedded"),
                   help="'embedded' (default, works offline), a Hugging Face hub id or a local LLaVA directory")
    p.add_argument("--device", default=_env("PREFIXKV_DEVICE", "auto"), help="auto, auto-multi, cpu, cuda, cuda:N")
    p.add_argument("--dtype", default=_env("PREFIXKV_DTYPE", "auto"), help="auto, float32, float16, bfloat16")
    p.add_argument("--host", default=_env("PREFIXKV_HOST", "127.0.0.1"),
                   help="address to listen on (default 127.0.0.1; 0.0.0.0 in Docker)")
    p.add_argument("--port", type=int, default=int(_env("PORT", "7860")), help="port (default 7860)")
    p.add_argument("--methods", default=_env("PREFIXKV_METHODS", "all"),
                   help="methods offered, 'all' or a comma list, e.g. full,snapkv,prefixkv")
    p.add_argument("--max-new-tokens-limit", type=int, default=int(_env("PREFIXKV_MAX_NEW_TOKENS_LIMIT", "256")),
                   help="upper end of the max-new-tokens slider (default 256)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("app")

    from prefixkv_core import Engine, ModelLoadError, PolicyError, load_model, resolve_methods

    try:
        methods = resolve_methods(args.methods)
    except PolicyError as exc:
        print(f"app.py: --methods: {exc}", file=sys.stderr)
        return 2
    if args.max_new_tokens_limit < 1:
        print("app.py: --max-new-tokens-limit must be at least 1", file=sys.stderr)
        return 2

    log.info("loading model %r (device=%s, dtype=%s)…", args.model, args.device, args.dtype)
    t0 = time.perf_counter()
    try:
        loaded = load_model(args.model, device=args.device, dtype=args.dtype)
    except ModelLoadError as exc:
        print(f"app.py: cannot load model {args.model!r}: {exc}", file=sys.stderr)
        return 1
    log.info("loaded %s on %s (%s) in %.1f s", loaded.name, loaded.device, loaded.dtype, time.perf_counter() - t0)
    for note in loaded.notes:
        log.info("model note: %s", note)

    from ui.app_builder import build_app, launch_kwargs

    demo = build_app(Engine(loaded), methods=methods, max_new_tokens_limit=args.max_new_tokens_limit)
    demo.launch(**launch_kwargs(args.host, args.port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
