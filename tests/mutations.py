"""One-line mutations of the engine and the tests that must then fail: a check that the tests prove what they
name, which a reviewer can run.

    python tests/mutations.py            # every mutation: applies it, runs its tests, restores the file
    python tests/mutations.py --list     # what each one breaks and which tests must catch it
    python tests/mutations.py true-length deepstack-cut

Each mutation replaces one exact piece of one file (it must occur there exactly once; `tests/test_mutations.py`
keeps the list in step with the code) and runs the named tests, which must fail. The file is restored afterwards,
also on an error or Ctrl-C. Exit status 1 when a mutation survives.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Mutation:
    name: str
    what: str  # the defect it plants
    path: str
    old: str
    new: str
    tests: tuple[str, ...]  # pytest node ids or `file -k expression`


MUTATIONS = (
    Mutation("true-length", "a session feeds each decode step at the number of entries its cache holds, not at the "
             "true position", "prefixkv_core/session/step_pool.py", "chunks, [s.true_len for s in states],",
             "chunks, [s.cache.layers[0].length for s in states],",
             ("tests/test_qwen_families.py -k true_length", "tests/test_internvl.py -k true_length",
              "tests/test_adakv.py")),
    Mutation("second-per-grid", "Qwen2.5-VL's video groups lose their seconds (the rope index's default of one "
             "second takes over)", "prefixkv_core/models/family/qwen_vl.py",
             'extra["second_per_grid_ts"] = inputs["second_per_grid_ts"]', "pass",
             ("tests/test_qwen_video.py -k rope_index_over",)),
    Mutation("deepstack-cut", "after a token drop, Qwen3-VL's DeepStack features are the first ones, not the kept "
             "tokens' own", "prefixkv_core/decoding/token_drop.py", "visual_embeds[cut(rank, index)[kept_masks]]",
             "visual_embeds[:int(kept_masks.sum())]", ("tests/test_qwen_families.py -k token_drop",)),
    Mutation("drop-rotary", "after a token drop, the kept tokens take the first positions' rotary embeddings",
             "prefixkv_core/decoding/token_drop.py",
             'handed["position_embeddings"] = tuple(cut(part, index) for part in whole["position_embeddings"])',
             'handed["position_embeddings"] = tuple(part[:, :index.shape[1]] for part in whole["position_embeddings"])',
             ("tests/test_qwen_families.py -k token_drop",)),
    Mutation("prompt-start", "a fed chunk's true positions start at the cache's length", "prefixkv_core/decoding/runner.py",
             "    positions = torch.full((b, 1), start, device=ids.device) if t == 1 else \\",
             "    start = cache.layers[0].length if cache.layers[0].keys is not None else start\n"
             "    positions = torch.full((b, 1), start, device=ids.device) if t == 1 else \\",
             ("tests/test_qwen_families.py -k eviction_equals_masking",)),
    Mutation("fixed-point", "Elastic Cache's and PrefixKV's fixed point moves by one entry",
             "prefixkv_core/policies/base.py", "        fp = k - FIXED_POINT_DISTANCE",
             "        fp = k - FIXED_POINT_DISTANCE + 1", ("tests/test_policy_plans_frozen.py -k 'elastic or prefixkv'",)),
    Mutation("nested-attention", "an inner tracked-attention block's exit puts the model back on sdpa",
             "prefixkv_core/kv/attention.py", "            if depth > 1:", "            if False:",
             ("tests/test_engine.py -k nested",)),
    Mutation("frame-meter", "decoded video frames are not measured (only the header is)",
             "prefixkv_core/session/video_input.py", "        if w * h > self.bounds.frame_limit:",
             "        if False:", ("tests/test_video_input.py -k every_decoded_frame",)),
    Mutation("seek", "sampled video frames are decoded in order from the start instead of reached by seeking",
             "prefixkv_core/session/video_input.py", "    if any(p.pts is None for p in packets) or",
             "    if True or", ("tests/test_video_input.py -k seeking",)),
    Mutation("high-depth", "16-bit images are converted by Pillow (clipped to white)", "prefixkv_core/limits.py",
             "        return as_rgb(im)", "        return im.convert('RGB')",
             ("tests/test_hostile_inputs.py -k 16_bit",)),
    Mutation("list-walk", "only the first 64 items of a list input are checked for URLs and server paths",
             "ui/inputs.py", "            stack.extend(item)", "            stack.extend(item[:64])",
             ("tests/test_hostile_inputs.py -k 64th",)),
    Mutation("one-limit", "the engine checks several images against the model's context, not the run's limit",
             "prefixkv_core/session/engine.py",
             "max_new_tokens=generation.max_new_tokens, token_limit=token_limit)",
             "max_new_tokens=generation.max_new_tokens)", ("tests/test_hostile_inputs.py -k model_context",)),
    Mutation("extra-operator", "every tracked forward launches one more operator", "prefixkv_core/kv/cache.py",
             "            self._pending_meta = (*per_head_meta(positions, is_image, n_kv),",
             "            self._pending_meta = (*per_head_meta(positions.clone(), is_image, n_kv),",
             ("tests/test_step_ops.py",)),
    Mutation("policy-sync", "the runner waits for the device before each row's planning (to time it)",
             "prefixkv_core/decoding/runner.py", "            plans = row.plans()\n",
             "            sync(device)\n            plans = row.plans()\n",
             ("tests/test_step_ops.py -k at_most_once",)),
    Mutation("range-shift", "a range drop moves the entries after it up by one, whatever the range's length",
             "prefixkv_core/kv/joint_eviction.py", "(written + shift).reshape(-1)",
             "(written + shift.clamp_max(1)).reshape(-1)", ("tests/test_entry_stores.py -k range_drops",)),
    Mutation("counts-apart", "a step reads its tokens back, and the image counts its evictions kept in reads of "
             "their own", "prefixkv_core/session/stepping.py",
             "greedy = read_with_counts(logits.argmax(dim=-1), self.unread_counts)",
             "greedy = logits.argmax(dim=-1).tolist()",
             ("tests/test_step_ops.py -k engine_waits",)),
    Mutation("local-sinks", "Local counts its sinks among the prompt's positions only",
             "prefixkv_core/policies/local.py", "sinks = min(self.sinks, view.true_len)",
             "sinks = min(self.sinks, view.prompt_len)", ("tests/test_policies_synthetic.py -k local_decode",)),
    Mutation("stale-lengths", "a batched step's row lengths on the device stay where they were when every row "
             "gained an entry", "prefixkv_core/decoding/step_lengths.py", "            self.ends.add_(1)",
             "            self.ends.add_(0)", ("tests/test_entry_stores.py -k move_on",)),
    Mutation("stale-meta-slots", "a prompt-only cache's metadata slots are not moved on after a step writes them",
             "prefixkv_core/kv/cache.py", "[n + 1 for n in lengths], slots.add_(1))", "[n + 1 for n in lengths], slots)",
             ("tests/test_entry_stores.py -k metadata_at_once",)),
    Mutation("scores-at-once", "a step's statistic is added into the rows' shared scores in the wrong rows",
             "prefixkv_core/decoding/step_attention.py", "target.add_(stat)", "target.add_(stat.flip(0))",
             ("tests/test_entry_stores.py -k attention_into",)),
    Mutation("code-table", "the packed codes are read highest bits first", "prefixkv_core/kv/quant.py",
             "(b >> (i * bits)) & mask", "(b >> ((per - 1 - i) * bits)) & mask",
             ("tests/test_quant.py -k whole_axis",)),
    Mutation("zipvl-late-attention", "ZipVL asks for a layer's attention one step after its block filled",
             "prefixkv_core/policies/zipvl.py", "if n + 1 >= self.decode_block)", "if n >= self.decode_block)",
             ("tests/test_runner.py -k zipvl_records",)),
)


def check(mutation: Mutation) -> str:
    """'caught', or why not: the tests passed with the defect in place, or the mutation no longer applies."""
    path = ROOT / mutation.path
    text = path.read_text()
    if text.count(mutation.old) != 1:
        return f"does not apply: the piece occurs {text.count(mutation.old)} times in {mutation.path}"
    try:
        path.write_text(text.replace(mutation.old, mutation.new))
        for spec in mutation.tests:
            command = f"{sys.executable} -m pytest -q -x -n 0 -p no:cacheprovider {spec}"
            done = subprocess.run(command, shell=True, cwd=ROOT, capture_output=True, text=True,
                                  env={**os.environ, "HF_HUB_OFFLINE": "1", "GRADIO_ANALYTICS_ENABLED": "False"})
            if done.returncode == 0:
                return f"survived: {spec} passed"
            if done.returncode not in (1,):  # 1: tests failed; anything else: pytest could not run them
                return f"not run: {spec} exited {done.returncode}: {done.stdout[-300:]}"
        return "caught"
    finally:
        path.write_text(text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("names", nargs="*", help="mutations to run (default: all)")
    p.add_argument("--list", action="store_true", help="list the mutations and their tests")
    args = p.parse_args(argv)
    chosen = [m for m in MUTATIONS if not args.names or m.name in args.names]
    unknown = set(args.names) - {m.name for m in MUTATIONS}
    if unknown:
        p.error(f"unknown mutations {sorted(unknown)}; see --list")
    if args.list:
        for m in chosen:
            print(f"{m.name}: {m.what}\n  {m.path}\n  must fail: {'; '.join(m.tests)}")
        return 0
    survived = 0
    for m in chosen:
        verdict = check(m)
        survived += verdict != "caught"
        print(f"{m.name:18} {verdict}")
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
