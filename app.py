"""PrefixKV Lab: compare KV-cache compression methods on a LLaVA model in the browser.

    python app.py                       # the embedded default model, http://127.0.0.1:7860
    python app.py --model llava-hf/llava-1.5-7b-hf --device cuda
"""
from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=os.environ.get("PREFIXKV_MODEL", "embedded"),
                   help="'embedded' (default, offline), a hub id or a local LLaVA directory")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    p.add_argument("--dtype", default="auto", help="auto, float32, float16, bfloat16")
    p.add_argument("--host", default=os.environ.get("PREFIXKV_HOST", "127.0.0.1"), help="address to listen on")
    p.add_argument("--port", type=int, default=int(os.environ.get("PORT", 7860)))
    p.add_argument("--methods", default="all", help="methods selected at start ('all' or a comma list)")
    p.add_argument("--max-new-tokens-limit", type=int, default=256, help="upper end of the max-new-tokens slider")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from prefixkv_core import Engine, load_model, resolve_methods
    from ui.app_builder import build_app
    from ui.theme import gradio_theme

    methods = resolve_methods(args.methods)
    engine = Engine(load_model(args.model, device=args.device, dtype=args.dtype))
    demo = build_app(engine, max_new_tokens_limit=args.max_new_tokens_limit, default_methods=methods)
    # one run at a time on one model; others wait in the queue and see their position
    demo.queue(default_concurrency_limit=1, max_size=32)
    demo.launch(server_name=args.host, server_port=args.port, share=False, max_file_size="10mb", theme=gradio_theme())
    return 0


if __name__ == "__main__":
    sys.exit(main())
