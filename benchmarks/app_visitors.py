"""The app as its visitors use it: the Gradio app launched in this process, driven through its API with
`gradio_client` (the stream, not only the final result), as a browser would.

For each request (one comparison: an image, a prompt, the methods, a budget) it measures, on the client's side:
- each visitor's time to the first streamed token (the first update in which any method has a token), to every
  method's first token, to the last token (the first update in which every method's answer is complete) and to
  the last update (the charts of the finished run drawn);
- every visitor alone (one after another: their sum is the "one after another" reference), then all of them sent
  at once (a barrier releases every client thread together), and the same requests through the engine at once
  with no app: `--repeats` rounds of the two, interleaved, each round's ratio reported (median and spread);
- whether every answer through the app is the one the engine gives for the same request (greedy decoding: it must
  be, whether a visitor is alone or beside others).

    python benchmarks/app_visitors.py --model embedded --clients 4 --repeats 3
    python benchmarks/app_visitors.py --random-weights llava-interleave --device cuda --clients 4   # Space shape
    python benchmarks/app_visitors.py --random-weights tiny-llava-interleave --clients 2 --new-tokens 4  # smoke
    python benchmarks/app_visitors.py --model embedded --engine-process both --repeats 3   # the model's process

`--engine-process on` serves the app as app.py does by default: the model in a process of its own (`EngineProcess`)
and this server process at a lower priority (`--server-nice`); `both` launches the two apps and alternates their
rounds (the server's priority is then lowered for both). `floor` serves the app beside a bare Gradio app on the
same engine process (`BareApp`: one streaming endpoint that sends each method's text on every event and nothing
else) and alternates their rounds: how much of the app's wait is any Gradio app's, and how much its own. The
engine-at-once reference runs in this process.

A warm-up request runs first (kernels, the first HTTP connection). `--json` writes every number.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from benchmarks.common import REPO_ROOT, run_info  # noqa: E402
from benchmarks.interactive import add_random_weights_arg, load_benchmark_model, plain_decode_tokens_per_s  # noqa: E402
from prefixkv_core import Engine, GenerationSettings, resolve_methods  # noqa: E402
from prefixkv_core.limits import Limits, peak_memory_bytes  # noqa: E402
from prefixkv_core.method_args import add_model_args  # noqa: E402
from prefixkv_core.report.record import ENDED_STATUSES  # noqa: E402
from prefixkv_core.session.model_worker import CHORE, PREFILL, STEP, ModelWorker  # noqa: E402

POOL_COUNTERS = ("steps", "shared_steps", "waited_out", "formed")

SCENES = ("scene-0.png", "scene-2.png", "scene-4.png", "chelsea.jpg", "coffee.jpg", "rocket.jpg", "astronaut.jpg",
          "retina.jpg")  # each visitor asks about another picture (shipped in assets/images)


class ServerProbe:
    """Where the server's time goes while visitors are served, measured in this process (the app runs here): the
    model thread's jobs by kind (decode steps, prefills and other model calls, chores), the redraws (how long each
    holds the comparison's record lock, which the engine needs to feed the record, and how long it builds the
    page's outputs), the overlay samples, and the step pool's counters (steps that went without a turn slow to
    ask, steps that formed the shared stores anew) and gradio's turning each update into what it sends. Wrappers
    installed by `start`, removed by `stop`."""

    KINDS = {STEP: "decode steps", PREFILL: "prefills and model calls", CHORE: "chores"}

    def __init__(self, engine):
        self.engine = engine
        # an EngineProcess: the model's thread is in the other process; its counters come through stats()
        self.remote = not isinstance(engine, Engine)
        self.lock = threading.Lock()
        self.seconds: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        self.spans: list[tuple[str, float, float]] = []  # (what, start, end) in perf_counter seconds
        self.arrivals: list[float] = []  # wall-clock times at which a Compare request's handler began
        self._saved: list[tuple[object, str, object]] = []
        self._before: dict = {}  # the counters when the probe started

    def add(self, key: str, seconds: float) -> None:
        end = time.perf_counter()
        with self.lock:
            self.seconds[key] = self.seconds.get(key, 0.0) + seconds
            self.counts[key] = self.counts.get(key, 0) + 1
            self.spans.append((key, end - seconds, end))

    def _wrap(self, owner, name: str, make) -> None:
        original = getattr(owner, name)
        self._saved.append((owner, name, original))
        setattr(owner, name, make(original))

    def start(self) -> "ServerProbe":
        from ui.overlay_sampler import OverlaySampler
        from ui.rendering import Renderer

        probe = self
        self.seconds, self.counts, self.spans, self.arrivals = {}, {}, [], []
        self.t0 = time.perf_counter()
        self._before = self._counters()
        self.cpu_first = self._cpu_seconds()  # taken again when the first request's handler begins

        def timed_put(original):
            def put(worker, priority, job):
                if job.fn is not None:
                    fn, kind = job.fn, ServerProbe.KINDS.get(priority, "other")

                    def run():
                        t0 = time.perf_counter()
                        try:
                            return fn()
                        finally:
                            probe.add(f"model thread: {kind}", time.perf_counter() - t0)
                    job.fn = run
                return original(worker, priority, job)
            return put

        def timed(key: str):
            def wrap(original):
                def method(*args, **kwargs):
                    t0 = time.perf_counter()
                    try:
                        return original(*args, **kwargs)
                    finally:
                        probe.add(key, time.perf_counter() - t0)
                return method
            return wrap

        def timed_async(key: str):
            def wrap(original):
                async def method(*args, **kwargs):
                    t0 = time.perf_counter()
                    try:
                        return await original(*args, **kwargs)
                    finally:
                        probe.add(key, time.perf_counter() - t0)
                return method
            return wrap

        def arrival(original):
            def compare(*args, **kwargs):  # a generator, as the handler is: it begins when gradio starts it
                if not probe.arrivals:  # the CPU from here on is the requests' (each client's page config before)
                    probe.cpu_first = probe._cpu_seconds()
                probe.arrivals.append(time.time())
                yield from original(*args, **kwargs)
            return compare

        from gradio.blocks import Blocks

        from ui.turns import Turns

        self._wrap(Turns, "compare", arrival)
        self._wrap(BareApp, "compare", arrival)
        from gradio.profiling import PROFILING_ENABLED, collector

        if PROFILING_ENABLED:
            collector.clear()

        self._wrap(Blocks, "postprocess_data", timed_async("gradio: outputs to the page (postprocess)"))
        self._wrap(ModelWorker, "_put", timed_put)
        self._wrap(Renderer, "render", timed("redraws (record lock held)"))
        self._wrap(OverlaySampler, "snapshot", timed("overlay samples (on the run's thread)"))
        import prefixkv_core.session.step_pool as step_pool
        import ui.sessions as sessions

        for module in (step_pool, sessions):  # each holds its own name for it
            self._wrap(module, "return_free_memory", timed("memory handed back to the system (malloc_trim)"))
        return self

    def _cpu_seconds(self) -> tuple[float, float | None]:
        """CPU seconds used so far by this process (every thread: the server, and with an in-process engine the model
        too) and by the engine's own process (None without one, or where /proc cannot tell). `stop` reports them from
        the first request's handler on, so that each new client's fetch of the page's config (a page load) is left
        out."""
        child = None
        if self.remote:
            try:
                fields = Path(f"/proc/{self.engine.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
                child = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
            except (OSError, ValueError, IndexError, AttributeError):
                child = None
        return time.process_time(), child

    def _counters(self) -> dict:
        """The step pool's counters, the shared prefills by rows and, for an EngineProcess, its model thread's busy
        seconds and jobs by priority (in this process the model thread's jobs are timed as they run instead)."""
        if not self.remote:
            pool = self.engine.pool
            return {"pool": {k: getattr(pool, k) for k in POOL_COUNTERS},
                    "prefills": dict(self.engine.prefills.forwards), "busy": None}
        stats = self.engine.stats()
        return {"pool": {k: stats[k] for k in POOL_COUNTERS}, "prefills": dict(stats["prefill_forwards"]),
                "busy": ({int(k): v for k, v in stats["model_busy_s"].items()},
                         {int(k): v for k, v in stats["model_jobs"].items()})}

    def _remote_model_thread(self, before: tuple[dict, dict], after: tuple[dict, dict]) -> None:
        """The engine process's model thread, from its own counters (jobs run on its thread, by kind)."""
        (busy0, jobs0), (busy1, jobs1) = before, after
        for priority, kind in ServerProbe.KINDS.items():
            if jobs1.get(priority, 0) > jobs0.get(priority, 0):
                key = f"model thread: {kind}"
                self.seconds[key] = busy1.get(priority, 0.0) - busy0.get(priority, 0.0)
                self.counts[key] = jobs1[priority] - jobs0.get(priority, 0)

    def stop(self) -> dict:
        while self._saved:
            owner, name, original = self._saved.pop()
            setattr(owner, name, original)
        before, after = self._before, self._counters()
        (server0, child0), (server1, child1) = self.cpu_first, self._cpu_seconds()
        if self.remote:
            self._remote_model_thread(before["busy"], after["busy"])
        return {"seconds": {k: round(v, 3) for k, v in sorted(self.seconds.items())}, "counts": dict(self.counts),
                "spans": [(k, round(a - self.t0, 4), round(b - self.t0, 4)) for k, a, b in self.spans],
                "pool": {k: after["pool"][k] - before["pool"].get(k, 0) for k in POOL_COUNTERS},
                "arrivals": list(self.arrivals), "wall_s": round(time.perf_counter() - self.t0, 3),
                "gradio_phases": gradio_phases(),
                "cpu_s": {"server": round(server1 - server0, 3),
                          "engine process": None if child0 is None or child1 is None else round(child1 - child0, 3)},
                "prefill_forwards": prefill_forwards(after["prefills"], before["prefills"])}


GRADIO_PHASES = ("queue_wait", "preprocess", "fn_call", "postprocess", "streaming_diff", "total")


def gradio_phases() -> dict | None:
    """gradio's own traces of the requests since the probe started (None unless GRADIO_PROFILING is on): per
    request of the comparison, each phase's milliseconds summed over the request's updates; the uploads' times."""
    from gradio.profiling import PROFILING_ENABLED, collector

    if not PROFILING_ENABLED:
        return None
    traces = collector.get_all()
    runs = [t for t in traces if t["fn_name"] == "compare"]
    return {"requests": [{k: round(t[f"{k}_ms"], 1) for k in GRADIO_PHASES} | {"updates": t["n_iterations"]}
                         for t in runs],
            # the traces' dicts leave the upload's time out; the summary has it
            "uploads": collector.get_summary().get("upload")}


def gradio_phases_text(phases: dict | None) -> list[str]:
    if not phases or not phases["requests"]:
        return []
    rows = phases["requests"]
    lines = ["", "gradio's own traces of the visitors at once (GRADIO_PROFILING; ms, summed over each request's "
             "updates):", "", "| request | " + " | ".join(k.replace("_", " ") for k in GRADIO_PHASES) + " | updates |",
             "|---|" + "---|" * (len(GRADIO_PHASES) + 1)]
    for i, row in enumerate(rows):
        lines.append(f"| {i + 1} | " + " | ".join(f"{row[k]:.0f}" for k in GRADIO_PHASES) + f" | {row['updates']} |")
    uploads = phases.get("uploads")
    if uploads:
        lines += ["", f"- the image uploads: {uploads['count']}, median {uploads['p50']:.0f} ms (up to "
                  f"{uploads['max']:.0f} ms)"]
    return lines


def prefill_forwards(now: dict[int, int], before: dict[int, int]) -> dict[int, int]:
    """Shared prefills run since `before`, by how many visitors' prompts each forward held."""
    return {rows: now[rows] - before.get(rows, 0) for rows in sorted(now) if now[rows] > before.get(rows, 0)}


def forwards_text(counts: dict) -> str:
    return ", ".join(f"{n} of {rows}" for rows, n in sorted((int(k), v) for k, v in counts.items())) or "none"


def launch(engine, max_new_tokens: int):
    """The app as app.py builds it with its default limits, on a free localhost port; returns (demo, url)."""
    from ui.app_builder import serve_locally

    return serve_locally(engine, max_new_tokens_limit=max(max_new_tokens, 1))


class BareApp:
    """The floor: a Gradio app with one streaming endpoint that runs the same session on the same engine and sends
    every method's text, token count and status on every event. No charts, no overlay, no per-visitor state, one
    output: what serving this engine through any Gradio app costs (HTTP, the upload, the queue, the stream), against
    which the app's own work is measured."""

    def __init__(self, engine, concurrency: int):
        self.engine = engine
        self.concurrency = concurrency

    def compare(self, image, prompt, methods, budget, max_new_tokens):
        session = self.engine.new_session(self.engine.load_image(image), prompt, list(methods), float(budget),
                                          GenerationSettings(max_new_tokens=int(max_new_tokens)))
        for _ in session.run():
            yield self.answers(session.record, finished=False)
        yield self.answers(session.record, finished=True)

    @staticmethod
    def answers(record, finished: bool) -> dict:
        rows = {}
        for m, track in record.tracks.items():
            turn = track.turn
            rows[m] = {"text": turn.answer if turn else "", "status": turn.status if turn else "waiting",
                       "tokens": track.last.step if track.last is not None else 0,
                       "error": turn.error if turn else None}
        return {"methods": rows, "finished": finished}

    def launch(self) -> tuple[object, str]:
        import gradio as gr

        from ui.app_builder import free_loopback_port

        port = free_loopback_port()
        with gr.Blocks(analytics_enabled=False) as demo:
            image = gr.Image(type="filepath")
            prompt = gr.Textbox()
            methods = gr.Dropdown(resolve_methods("all"), multiselect=True)
            budget = gr.Number()
            new_tokens = gr.Number(precision=0)
            out = gr.JSON()

            def compare(image, prompt, methods, budget, max_new_tokens):  # looked up per request: the probe wraps it
                yield from self.compare(image, prompt, methods, budget, max_new_tokens)

            gr.Button().click(compare, [image, prompt, methods, budget, new_tokens], [out], api_name="compare",
                              concurrency_limit=self.concurrency)
        demo.queue()
        demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True)
        return demo, f"http://127.0.0.1:{port}/"


def visit(url: str, image: str, prompt: str, methods: list[str], budget: float, new_tokens: int,
          start: threading.Barrier | None = None) -> dict:
    """One visitor: open a client, (wait for the others,) send one comparison and time its stream."""
    from gradio_client import Client, handle_file

    client = Client(url, verbose=False, download_files=False, httpx_kwargs={"timeout": 600})
    if start is not None:
        start.wait()
    sent_at = time.time()  # wall clock: the server's process reads the same one
    t0 = time.perf_counter()
    job = client.submit(handle_file(image), prompt, methods, budget, new_tokens, api_name="/compare")
    first: dict[str, float] = {}
    last_token = None  # the first update in which every method's answer is complete
    updates = 0
    for update in job:
        t = time.perf_counter() - t0
        updates += 1
        results = update[-1] if isinstance(update, (list, tuple)) and update else update  # the bare app: one output
        if not isinstance(results, dict):
            continue
        rows = (results.get("methods") or {}).items()
        for m, r in rows:
            if r.get("tokens", 0) >= 1 and m not in first:
                first[m] = t
        if last_token is None and rows and all(r.get("status") in ENDED_STATUSES for _, r in rows):
            last_token = t
    final = job.result()
    last = time.perf_counter() - t0
    results = final if isinstance(final, dict) else final[-1]
    return {"image": Path(image).name, "sent_at": sent_at, "first_token_s": min(first.values(), default=None),
            "method_first_token_s": first, "last_token_s": last_token if last_token is not None else last,
            "last_s": last,
            "updates": updates, "finished": bool(results.get("finished")),
            "texts": {m: r["text"] for m, r in results["methods"].items()},
            "errors": {m: r["error"] for m, r in results["methods"].items() if r.get("error")}}


def _client_process_setup() -> None:
    """The visitors' process yields the processors to the server's (their browsers would be elsewhere)."""
    os.nice(19 - os.nice(0))


class Visitors:
    """`visit` and `at_once` run in one other process: parsing the streamed updates is the visitors' work and must
    not take this process's interpreter from the server (in one process it would, through the GIL)."""

    def __init__(self):
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        self.pool = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"),
                                        initializer=_client_process_setup)

    def visit(self, *args) -> dict:
        return self.pool.submit(visit, *args).result()

    def at_once(self, *args) -> dict:
        return self.pool.submit(at_once, *args).result()

    def close(self) -> None:
        self.pool.shutdown(cancel_futures=True)


def in_threads(work, n: int) -> None:
    """work(0) ... work(n - 1), each on a thread of its own, all started before any is waited for."""
    threads = [threading.Thread(target=work, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def engine_alone(engine: Engine, image: str, prompt: str, methods: list[str], budget: float,
                 new_tokens: int) -> dict:
    """The same request through the engine directly, with the app's generation settings: the answers the app must
    show, the request's wall time and its prefill's."""
    t0 = time.perf_counter()
    session = engine.new_session(Engine.load_image(image), prompt, methods, budget,
                                 GenerationSettings(max_new_tokens=new_tokens))
    for _ in session.run():
        pass
    return {"texts": {m: r["text"] for m, r in session.record.to_dict()["methods"].items()},
            "wall_s": time.perf_counter() - t0, "prefill_s": session.prefill.prefill_s}


def engine_at_once(engine: Engine, images: list[str], prompt: str, methods: list[str], budget: float,
                   new_tokens: int) -> dict:
    """The same requests through the engine directly, all at once (a thread each, as the app runs them): what the
    engine gives without the app around it."""
    t0 = time.perf_counter()
    walls: list[float | None] = [None] * len(images)

    def one(i: int) -> None:
        engine_alone(engine, images[i], prompt, methods, budget, new_tokens)
        walls[i] = time.perf_counter() - t0

    in_threads(one, len(images))
    return {"last_s": max(w for w in walls if w is not None), "each_s": walls}


def hardware_bound(loaded, image: str, prompt: str, alone: dict, rows: int, users: int, new_tokens: int) -> dict:
    """The least the last visitor can wait on this hardware (`several_users.hardware_bound_s`), from one request
    alone through the engine (`alone`, an `engine_alone` result for `image`) and plain transformers' batching
    ceilings for the decode and the prefill."""
    from benchmarks.several_users import hardware_bound_s, plain_prefill_prompts_per_s
    from prefixkv_core.models import encode, format_prompt

    alone_s, prefill_s = alone["wall_s"], alone["prefill_s"]
    inputs = encode(loaded, Engine.load_image(image), format_prompt(loaded, prompt, with_image=True))
    ceiling = (plain_decode_tokens_per_s(loaded, inputs, new_tokens, rows * users)
               / plain_decode_tokens_per_s(loaded, inputs, new_tokens, rows))
    prefill_ceiling = plain_prefill_prompts_per_s(loaded, inputs, users) / plain_prefill_prompts_per_s(loaded, inputs, 1)
    return {"alone_s": alone_s, "prefill_s": prefill_s, "ceiling": ceiling, "prefill_ceiling": prefill_ceiling,
            "bound_s": hardware_bound_s(users, prefill_s, alone_s, prefill_ceiling, ceiling)}


def at_once(url: str, images: list[str], prompt: str, methods: list[str], budget: float, new_tokens: int) -> dict:
    """Every visitor sent at once; each one's times from its own request."""
    barrier = threading.Barrier(len(images))
    out: list[dict | None] = [None] * len(images)
    errors: list[str] = []

    def one(i: int) -> None:
        try:
            out[i] = visit(url, images[i], prompt, methods, budget, new_tokens, barrier)
        except Exception as exc:  # noqa: BLE001 - reported, the others go on
            errors.append(f"visitor {i}: {type(exc).__name__}: {exc}")
            barrier.abort()

    t0 = time.perf_counter()
    in_threads(one, len(images))
    return {"wall_s": time.perf_counter() - t0, "visitors": out, "errors": errors}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    add_random_weights_arg(ap)
    ap.add_argument("--prompt", default="Describe the image in detail.")
    ap.add_argument("--methods", default="full,h2o,snapkv,prefixkv")
    ap.add_argument("--budget", type=float, default=0.3)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--clients", type=int, default=4, help="visitors sent at once (default 4)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="rounds of the visitors at once through the app and the same requests through the engine "
                         "at once, interleaved (medians and spreads reported)")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's choice)")
    ap.add_argument("--fixed-pace", action="store_true",
                    help="redraw every stream at the fixed pace (panels every 0.25 s, charts every second) instead "
                         "of spacing redraws by their cost and the number of streams: the app before that change")
    ap.add_argument("--engine-process", choices=("off", "on", "both", "floor"), default="off",
                    help="on: the app's model in a process of its own, as app.py runs it by default; both: the two "
                         "apps, their rounds alternated; floor: the app and a bare Gradio app on the same engine "
                         "process, their rounds alternated (default off: the model in this process)")
    ap.add_argument("--server-nice", type=int, default=10,
                    help="with --engine-process on or both: lower this server process's priority by this much, as "
                         "app.py does (default 10)")
    ap.add_argument("--gradio-profiling", action="store_true",
                    help="turn on gradio's own request traces (GRADIO_PROFILING) and report their phases for the "
                         "visitors at once: the wait in gradio's queue, preprocess, the function's calls, "
                         "postprocess, the upload")
    ap.add_argument("--json", default=None, help="write every number here")
    return ap


VARIANTS = {"off": ["in-process"], "on": ["engine process"], "both": ["in-process", "engine process"],
            "floor": ["engine process", "bare app"]}


def start_engine_process(args):
    """The app's model in a process of its own, loaded as this process loaded it."""
    from prefixkv_core import EngineProcess

    if args.random_weights is not None:
        return EngineProcess(args.random_weights, device=args.device, dtype=args.dtype, threads=args.threads or None,
                             loader="benchmarks.interactive:load_random_model")
    return EngineProcess(args.model, device=args.device, dtype=args.dtype, threads=args.threads or None)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.clients < 1 or args.new_tokens < 1:
        raise SystemExit("--clients and --new-tokens must be at least 1")
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    if args.gradio_profiling:  # read once, when gradio is first imported (by the apps' launch, below)
        if "gradio" in sys.modules:
            raise SystemExit("--gradio-profiling: gradio was imported before the flag could turn its traces on")
        os.environ["GRADIO_PROFILING"] = "1"
    methods = resolve_methods(args.methods)
    images = [str(REPO_ROOT / "assets" / "images" / SCENES[i % len(SCENES)]) for i in range(args.clients)]

    t_load = time.perf_counter()
    loaded = load_benchmark_model(args)
    load_s = time.perf_counter() - t_load
    progress(f"model ready in {load_s:.1f} s: {loaded.name} on {loaded.device}")
    if args.fixed_pace:
        from ui import run_stream

        run_stream.CHART_SHARE = run_stream.TEXT_SHARE = float("inf")
    engine = Engine(loaded)  # the app's engine in this process, and the engine-at-once reference
    variants = VARIANTS[args.engine_process]
    remote = None
    if "engine process" in variants or "bare app" in variants:
        remote = start_engine_process(args)
        progress(f"the engine's own process is up (pid {remote.process.pid})")
        if args.server_nice:
            os.nice(args.server_nice)  # this process; the engine's was started before
    served = {v: BareApp(remote, Limits().max_batch_users).launch() if v == "bare app"
              else launch(engine if v == "in-process" else remote, args.new_tokens) for v in variants}
    progress("app up at " + ", ".join(f"{url} ({v})" for v, (_, url) in served.items()))
    clients = Visitors()  # the visitors' side in a process of its own, as browsers are
    runs = {v: {"alone": None, "where_alone": None, "rounds": []} for v in variants}
    try:
        for v, (_, url) in served.items():
            clients.visit(url, images[0], args.prompt, methods, args.budget, min(4, args.new_tokens))  # warm-up
            probe = ServerProbe(engine if v == "in-process" else remote).start()
            alone = []
            for i, img in enumerate(images):
                alone.append(clients.visit(url, img, args.prompt, methods, args.budget, args.new_tokens))
                progress(f"{v}: visitor {i + 1} alone: last update after {alone[-1]['last_s']:.2f} s")
            runs[v]["alone"], runs[v]["where_alone"] = alone, probe.stop()
        for r in range(args.repeats):  # the app(s) and the engine at once, interleaved
            for v, (_, url) in served.items():
                probe = ServerProbe(engine if v == "in-process" else remote).start()
                together = clients.at_once(url, images, args.prompt, methods, args.budget, args.new_tokens)
                where = probe.stop()
                engine_once = engine_at_once(engine, images, args.prompt, methods, args.budget, args.new_tokens)
                runs[v]["rounds"].append({"together": together, "where": where, "engine_at_once": engine_once})
                progress(f"round {r + 1}, {v}: {args.clients} visitors at once through the app "
                         f"{together['wall_s']:.2f} s, the same through the engine {engine_once['last_s']:.2f} s")
    finally:
        clients.close()
        for demo, _ in served.values():
            demo.close()
        engine_peak = None
        if remote is not None:
            if remote.alive:
                engine_peak = remote.stats()["peak_resident_bytes"]
            remote.close()
    engine_runs = [engine_alone(engine, img, args.prompt, methods, args.budget, args.new_tokens) for img in images]
    expected = [run["texts"] for run in engine_runs]
    bound = hardware_bound(loaded, images[0], args.prompt, engine_runs[0], len(methods), len(images), args.new_tokens)
    progress(f"the least possible wait on this hardware: {bound['bound_s']:.2f} s")
    info = {**run_info(loaded.device), "model": loaded.name, "dtype": str(loaded.dtype), "load_s": load_s,
            "methods": methods, "budget": args.budget, "new_tokens": args.new_tokens, "clients": args.clients,
            "pace": ("fixed" if args.fixed_pace else "by cost and load"), "repeats": args.repeats,
            "prompt": args.prompt, "server_nice": args.server_nice if remote is not None else 0}
    reports = {v: variant_report(info, v, run, expected, bound) for v, run in runs.items()}
    for v in ("engine process", "bare app"):
        if v in reports:
            reports[v]["engine_peak_resident_bytes"] = engine_peak
    for v, report in reports.items():
        if len(reports) > 1:
            print(f"\n### {v}\n")
        print(markdown(report))
    if len(reports) > 1:
        print("\n" + comparison_text(reports))
    if args.json:
        Path(args.json).write_text(json.dumps(reports if len(reports) > 1 else next(iter(reports.values())),
                                              indent=1, default=str) + "\n")
    failed = any(rnd["together"]["errors"] for run in runs.values() for rnd in run["rounds"])
    return 0 if not failed and all(r["same_as_engine_alone"] for r in reports.values()) else 1


def variant_report(info: dict, variant: str, run: dict, expected: list[dict], bound: dict) -> dict:
    """One app's figures: its visitors alone and at once, each round against the engine at once."""
    def same(visits):
        return all(r is not None and r["texts"] == e for r, e in zip(visits, expected))

    alone, rounds = run["alone"], run["rounds"]
    alone_last = [r["last_s"] for r in alone]
    for rnd in rounds:
        visitors = [v for v in rnd["together"]["visitors"] if v is not None]
        rnd["last_s"] = max((v["last_s"] for v in visitors), default=None)
        rnd["over_engine"] = rnd["last_s"] / rnd["engine_at_once"]["last_s"] if rnd["last_s"] else None
        rnd["last_token_s"] = max((v["last_token_s"] for v in visitors), default=None)
        rnd["token_over_engine"] = (rnd["last_token_s"] / rnd["engine_at_once"]["last_s"] if rnd["last_token_s"]
                                    else None)
        rnd["over_one_after_another"] = rnd["together"]["wall_s"] / sum(alone_last)
    middle = sorted(rounds, key=lambda x: x["over_engine"] or 0)[len(rounds) // 2]  # the median round's details
    together, last = middle["together"], middle["last_s"]
    return {
        **info, "variant": variant, "alone": alone, "together": together, "rounds": rounds,
        "alone_first_token_s": statistics.median(r["first_token_s"] for r in alone if r["first_token_s"]),
        "alone_last_s": statistics.median(alone_last),
        "one_after_another_s": sum(alone_last),
        "together_wall_s": together["wall_s"],
        "together_last_wait_s": last,
        "last_over_alone": last / statistics.median(alone_last) if last else None,
        "together_over_one_after_another": together["wall_s"] / sum(alone_last),
        "engine_at_once": middle["engine_at_once"], "hardware_bound": bound,
        "last_over_engine_at_once": middle["over_engine"],
        "last_token_over_engine_at_once": middle["token_over_engine"],
        "last_over_hardware_bound": last / bound["bound_s"] if last else None,
        "where_alone": run["where_alone"], "where_together": middle["where"],
        "peak_resident_bytes": peak_memory_bytes(),  # the server's (model, caches, app; the visitors run elsewhere)
        "same_as_engine_alone": same(alone),
        "same_as_engine_together": all(same(rnd["together"]["visitors"]) for rnd in rounds),
    }


def comparison_text(reports: dict) -> str:
    """The apps side by side: per variant, the last visitor over the engine at once, median (spread) over rounds."""
    lines = ["| app | the last visitor's last token over the engine at once: median (lowest-highest) | its last update "
             "| all at once over one after another | first token at once (median of visitors) |", "|---|---|---|---|---|"]
    for v, r in reports.items():
        token = sorted(x["token_over_engine"] for x in r["rounds"] if x["token_over_engine"])
        over = sorted(x["over_engine"] for x in r["rounds"] if x["over_engine"])
        whole = sorted(x["over_one_after_another"] for x in r["rounds"])
        firsts = [t["first_token_s"] for t in r["together"]["visitors"] if t and t["first_token_s"]]
        lines.append(f"| {v} | {statistics.median(token):.2f}x ({token[0]:.2f}-{token[-1]:.2f}x) | "
                     f"{statistics.median(over):.2f}x ({over[0]:.2f}-{over[-1]:.2f}x) | "
                     f"{statistics.median(whole):.2f}x ({whole[0]:.2f}-{whole[-1]:.2f}x) | "
                     f"{statistics.median(firsts):.2f} s |" if over and firsts and token else f"| {v} | – | – | – | – |")
    return "\n".join(lines)


def progress(message: str) -> None:
    """One line per stage, at once: a run stopped from outside still shows how far it got."""
    print(f"[app_visitors] {message}", file=sys.stderr, flush=True)


def markdown(r: dict) -> str:
    def s(v):
        return "–" if v is None else f"{v:.2f} s"

    where = ("the model in the server's process" if r.get("variant") == "in-process" else
             "the model in a process of its own, the server at nice " + str(r["server_nice"])
             + (" (a bare Gradio app: one endpoint streaming the answers, nothing else)"
                if r.get("variant") == "bare app" else ""))
    lines = [f"App through its API: {r['model']} ({r['dtype']}) on {r['machine']}; {', '.join(r['methods'])} at "
             f"r = {r['budget']}, {r['new_tokens']} new tokens, {r['clients']} visitor(s); redraw pace: "
             f"{r['pace']}; {r['torch_threads']} torch threads; {where}.", "",
             "| visitor | image | alone: first token | alone: last token | alone: last update | at once: first token "
             "| at once: last token | at once: last update |",
             "|---|---|---|---|---|---|---|---|"]
    for i, (a, t) in enumerate(zip(r["alone"], r["together"]["visitors"])):
        lines.append(f"| {i + 1} | {a['image']} | {s(a['first_token_s'])} | {s(a['last_token_s'])} | {s(a['last_s'])} | "
                     f"{s(t and t['first_token_s'])} | {s(t and t['last_token_s'])} | {s(t and t['last_s'])} |")
    ratio = r["last_over_alone"]
    sent = [t["sent_at"] for t in r["together"]["visitors"] if t]
    arrivals = sorted(r["where_together"].get("arrivals", []))
    if sent and arrivals:
        lines += ["", "- the requests reached the app's handler (from the moment the visitors sent them, the image "
                  "upload included): " + ", ".join(f"{a - min(sent):.2f} s" for a in arrivals)]
    lines += ["", f"- one after another: {r['one_after_another_s']:.2f} s; all at once: {r['together_wall_s']:.2f} s "
              f"({r['together_over_one_after_another']:.2f}x)",
              f"- the last visitor at once over one alone: {'–' if ratio is None else f'{ratio:.2f}x'}",
              f"- every answer the engine's: alone {'yes' if r['same_as_engine_alone'] else 'NO'}, at once "
              f"{'yes' if r['same_as_engine_together'] else 'NO'}"]
    if len(r["rounds"]) > 1:
        def spread(key):
            values = sorted(rnd[key] for rnd in r["rounds"] if rnd[key] is not None)
            return f"{statistics.median(values):.2f}x ({values[0]:.2f}-{values[-1]:.2f}x)" if values else "–"

        lines += [f"- over {len(r['rounds'])} rounds, the app at once and the engine at once interleaved, median "
                  f"(lowest-highest): the last visitor's last token over the engine's last answer "
                  f"{spread('token_over_engine')}, its last update (the charts drawn) {spread('over_engine')}; all at once over one after another {spread('over_one_after_another')} (the tables show the "
                  "median round)"]
    eng, bound = r["engine_at_once"], r["hardware_bound"]
    cpu = r["where_together"].get("cpu_s")
    if cpu:
        alone_cpu = r["where_alone"].get("cpu_s", {})
        def cpu_text(c, n):
            parts = [f"this process {c['server']:.2f} s"] + (
                [f"the engine process {c['engine process']:.2f} s"] if c.get("engine process") is not None else [])
            return ", ".join(parts) + f" ({c['server'] / n:.2f} s a visitor here)"
        lines.append("- CPU seconds from the first request's handler on (each new client fetches the page's config "
                     f"before, as a page load): at once: {cpu_text(cpu, r['clients'])}"
                     + (f"; alone, one after another: {cpu_text(alone_cpu, r['clients'])}" if alone_cpu else ""))
    if r.get("peak_resident_bytes"):
        lines.append(f"- the server's peak resident memory: {r['peak_resident_bytes'] / 2**30:.2f} GiB")
    if r.get("engine_peak_resident_bytes"):
        lines.append(f"- the engine process's peak resident memory: {r['engine_peak_resident_bytes'] / 2**30:.2f} GiB")
    lines += [f"- the same requests through the engine at once, no app: last {eng['last_s']:.2f} s; the app's last "
              f"visitor's last token over it: {r['last_token_over_engine_at_once']:.2f}x, its last update: "
              f"{r['last_over_engine_at_once']:.2f}x",
              f"- the least possible wait here (prefills batched at {bound['prefill_ceiling']:.2f}x, one decode of every "
              f"row at {bound['ceiling']:.2f}x): {bound['bound_s']:.2f} s; the app's last visitor over it: "
              f"{r['last_over_hardware_bound']:.2f}x", "",
              "Where the server's time went (seconds summed over threads; calls):", "",
              "| | one after another | at once |", "|---|---|---|"]
    keys = sorted(set(r["where_alone"]["seconds"]) | set(r["where_together"]["seconds"]))
    for k in keys:
        cells = [f"{w['seconds'].get(k, 0):.2f} s ({w['counts'].get(k, 0)})" for w in (r["where_alone"], r["where_together"])]
        lines.append(f"| {k} | {cells[0]} | {cells[1]} |")
    for k in POOL_COUNTERS:
        lines.append(f"| step pool: {k.replace('_', ' ')} | {r['where_alone']['pool'][k]} | {r['where_together']['pool'][k]} |")
    lines.append(f"| shared prefills: forwards of k visitors' prompts (forwards of k) | "
                 f"{forwards_text(r['where_alone'].get('prefill_forwards', {}))} | "
                 f"{forwards_text(r['where_together'].get('prefill_forwards', {}))} |")
    lines += gradio_phases_text(r["where_together"].get("gradio_phases"))
    if r["together"]["errors"]:
        lines.append(f"- errors: {r['together']['errors']}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
