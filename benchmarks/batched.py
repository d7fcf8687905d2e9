"""Batched prefill + decode for the speed benchmark, built from the engine's public pieces (TrackedCache,
tracked_attention_enabled, AttentionProbe, the policies, apply_plans), plus randomly initialised models with
the exact shapes of LLaVA-1.5-7B / 13B (speed and memory do not depend on the weight values).

The engine's Session runs one conversation. Here B prompts of equal length and equal layout (BOS, image
block, text) share one cache tensor per layer, so a method can run batched only when its per-layer kept
counts do not depend on the sample: see BATCHABLE. The others run the B prompts one after another at
batch 1 ("sequential") and say so.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from prefixkv_core.attention import AttentionProbe, StatRequest, tracked_attention_enabled
from prefixkv_core.cache import TrackedCache
from prefixkv_core.models import TextShape
from prefixkv_core.policies import Policy, make_policy
from prefixkv_core.policies.base import DecodeView, PrefillView, apply_plans

# Methods whose per-layer counts are the same for every row of a batch of equal-layout prompts.
# (PrefixKV only with offline/fixed ratios; LOOK-M's text count is shared because the layout is shared.)
# Elastic Cache (anchors per sample in its merge), ZipVL (adaptive 4-bit share per sample) and online
# PrefixKV (per-sample search) are batch 1 only.
BATCHABLE = ("full", "local", "h2o", "snapkv", "pyramidkv", "lookm", "prefixkv")
STOCK = "full-stock"  # plain DynamicCache + stock sdpa attention: the engine-free baseline


def can_batch(method: str, knobs: dict[str, Any] | None = None) -> bool:
    if method == STOCK:
        return True
    if method == "prefixkv":
        return (knobs or {}).get("mode", "offline") == "offline"
    return method in BATCHABLE


# -- models --------------------------------------------------------------------------------------------------

@dataclass
class SpeedModel(TextShape):
    """What the speed benchmark needs of a LLaVA model: no tokenizer or processor (prompts are synthetic)."""

    model: Any
    name: str
    slug: str
    device: torch.device
    dtype: torch.dtype
    image_token_id: int
    image_seq_length: int
    image_size: int
    vocab_size: int
    bos_id: int
    random_weights: bool
    notes: list[str] = field(default_factory=list)

    @property
    def max_context(self) -> int:
        return int(getattr(self.text_config, "max_position_embeddings", 0) or 0)

    def kv_bytes_per_token(self) -> int:
        """Keys + values of one token over all layers, uncompressed, in the model's dtype."""
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem

    def param_count(self) -> int:
        return sum(p.numel() for p in self.model.parameters())


def from_loaded(loaded) -> SpeedModel:
    cfg = loaded.model.config
    tok = loaded.processor.tokenizer
    return SpeedModel(
        model=loaded.model, name=loaded.name, slug=loaded.slug, device=loaded.device, dtype=loaded.dtype,
        image_token_id=loaded.image_token_id, image_seq_length=loaded.image_seq_length,
        image_size=int(cfg.vision_config.image_size), vocab_size=int(cfg.get_text_config().vocab_size),
        bos_id=int(tok.bos_token_id if tok.bos_token_id is not None else 1), random_weights=False,
        notes=list(loaded.notes))


def _llava_1_5_config(size: str):
    """LLaVA-1.5 as released (llava-hf/llava-1.5-{7b,13b}-hf): CLIP ViT-L/14-336 + Llama-2 (Vicuna-1.5)."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

    text_dims = {"7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                            num_key_value_heads=32),
                 "13b": dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=40, num_attention_heads=40,
                             num_key_value_heads=40)}[size]
    vision = CLIPVisionConfig(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                              image_size=336, patch_size=14, projection_dim=768, hidden_act="quick_gelu",
                              layer_norm_eps=1e-5)
    text = LlamaConfig(vocab_size=32064, max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0,
                       hidden_act="silu", bos_token_id=1, eos_token_id=2, pad_token_id=32001,
                       tie_word_embeddings=False, **text_dims)
    return LlavaConfig(vision_config=vision, text_config=text, image_token_id=32000, image_seq_length=576,
                       vision_feature_layer=-2, vision_feature_select_strategy="default",
                       projector_hidden_act="gelu", tie_word_embeddings=False)


def _embedded_config():
    """The embedded model's shapes (SmolLM2-135M text, 6-layer CLIP-style vision at 192 px, 144 image tokens)."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

    vision = CLIPVisionConfig(image_size=192, patch_size=16, hidden_size=384, intermediate_size=1536,
                              num_hidden_layers=6, num_attention_heads=6, projection_dim=384)
    text = LlamaConfig(vocab_size=49216, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                       num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
                       rms_norm_eps=1e-5, rope_theta=100000.0, bos_token_id=1, eos_token_id=2, pad_token_id=2,
                       tie_word_embeddings=True)
    return LlavaConfig(vision_config=vision, text_config=text, image_token_id=49152, image_seq_length=144,
                       vision_feature_layer=-1, vision_feature_select_strategy="default",
                       projector_hidden_act="gelu", tie_word_embeddings=True)


def _tiny_config():
    """The test suite's tiny shapes (4 layers, 64 wide, 16 image tokens)."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

    vision = CLIPVisionConfig(image_size=32, patch_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=2, projection_dim=32)
    text = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=2048, bos_token_id=1,
                       eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    return LlavaConfig(vision_config=vision, text_config=text, image_token_id=511, image_seq_length=16,
                       vision_feature_layer=-1, vision_feature_select_strategy="default",
                       projector_hidden_act="gelu", tie_word_embeddings=False)


RANDOM_CONFIGS: dict[str, Callable[[], Any]] = {
    "llava-1.5-7b": lambda: _llava_1_5_config("7b"),
    "llava-1.5-13b": lambda: _llava_1_5_config("13b"),
    "embedded": _embedded_config,
    "tiny": _tiny_config,
}


def random_config(kind: str):
    if kind not in RANDOM_CONFIGS:
        raise ValueError(f"unknown --random-weights {kind!r}; accepted: {', '.join(RANDOM_CONFIGS)}")
    return RANDOM_CONFIGS[kind]()


def build_random_model(kind: str, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                       seed: int = 0) -> SpeedModel:
    """A randomly initialised LLaVA with the exact shapes of `kind`, created directly on `device` in `dtype`
    (no CPU copy, no float32 detour: a 7B model is built on the GPU in bf16 in seconds)."""
    from transformers import LlavaForConditionalGeneration

    config = random_config(kind)
    device = torch.device(device)
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlavaForConditionalGeneration._from_config(config, dtype=dtype, attn_implementation="sdpa")
    model.eval()
    model.requires_grad_(False)
    text = config.get_text_config()
    n_img = int(config.image_seq_length)
    return SpeedModel(
        model=model, name=f"random-{kind}", slug=f"random-{kind}", device=device, dtype=dtype,
        image_token_id=int(config.image_token_id), image_seq_length=n_img,
        image_size=int(config.vision_config.image_size), vocab_size=int(text.vocab_size),
        bos_id=int(text.bos_token_id or 1), random_weights=True,
        notes=[f"randomly initialised weights with the shapes of {kind}: speed and memory only, outputs are noise"])


# -- inputs ----------------------------------------------------------------------------------------------------

def synthetic_batch(sm: SpeedModel, batch: int, prompt_len: int, seed: int = 0):
    """B prompts of exactly `prompt_len` tokens: BOS, the image block, random text ids. Same layout in every row.
    Returns input_ids [B, N], is_image [B, N] (bool), pixel_values [B, 3, S, S] in the model's dtype."""
    n_img = sm.image_seq_length
    if prompt_len < n_img + 2:
        raise ValueError(f"prompt length {prompt_len} is shorter than the image block ({n_img} tokens) + BOS + 1 "
                         f"text token; use at least {n_img + 2}")
    g = torch.Generator().manual_seed(seed)
    hi = sm.image_token_id if sm.image_token_id > sm.vocab_size // 2 else sm.vocab_size
    ids = torch.randint(3, hi, (batch, prompt_len), generator=g)
    ids[ids == sm.image_token_id] = 3
    ids[:, 0] = sm.bos_id
    ids[:, 1:1 + n_img] = sm.image_token_id
    is_image = ids == sm.image_token_id
    pixels = torch.randn(batch, 3, sm.image_size, sm.image_size, generator=g)
    return ids.to(sm.device), is_image.to(sm.device), pixels.to(sm.device, sm.dtype)


# -- runners ---------------------------------------------------------------------------------------------------

def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class BatchedRun:
    """One method on a batch of equal-layout prompts: prefill (with the statistics the policy asks for) then
    compress, then greedy decode steps, each followed by the policy's decode-time compression."""

    def __init__(self, sm: SpeedModel, policy: Policy, budget: float):
        self.sm, self.policy, self.budget = sm, policy, budget
        self.cache = TrackedCache(sm.num_layers)
        self.prompt_len = 0
        self.true_len = 0
        self.step_no = 0

    def _forward(self, ids, start, probe, is_image=None, pixel_values=None) -> torch.Tensor:
        b, t = ids.shape
        positions = torch.arange(start, start + t, device=ids.device).unsqueeze(0).expand(b, -1)
        flags = is_image if is_image is not None else torch.zeros_like(ids, dtype=torch.bool)
        self.cache.set_pending(positions, flags)
        kwargs = {"pixel_values": pixel_values} if pixel_values is not None else {}
        out = self.sm.model(input_ids=ids, position_ids=positions, past_key_values=self.cache, use_cache=True,
                            logits_to_keep=1, kv_probe=probe, **kwargs)
        return out.logits[:, -1]

    @torch.inference_mode()
    def prefill(self, ids, is_image, pixel_values) -> torch.Tensor:
        n = ids.shape[1]
        request = self.policy.prefill_stats(n)
        request.colsum = True
        probe = AttentionProbe(request)
        logits = self._forward(ids, 0, probe, is_image, pixel_values)
        self.cache.add_scores({l: s["colsum"] for l, s in probe.stats.items()})
        view = PrefillView(self.cache, probe.stats, n, self.budget, request.window, None)
        apply_plans(self.cache, self.policy.prefill(view))
        self.prompt_len = self.true_len = n
        return logits.argmax(dim=-1)

    @torch.inference_mode()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        probe = AttentionProbe(StatRequest(last_query=self.policy.decode_needs_attention()))
        logits = self._forward(tokens.view(-1, 1), self.true_len, probe)
        self.true_len += 1
        self.step_no += 1
        attention = None
        if probe.request.last_query:
            attention = {l: s["last_query"] for l, s in probe.stats.items()}
            self.cache.add_scores(attention)
        view = DecodeView(self.cache, self.true_len, self.prompt_len, self.step_no, attention)
        apply_plans(self.cache, self.policy.decode(view))
        return logits.argmax(dim=-1)

    def kv_bytes(self) -> int:
        return self.cache.nbytes()

    def kept_per_layer(self) -> list[int]:
        return self.cache.lengths()


class StockRun:
    """Full cache through transformers' own DynamicCache and stock sdpa attention (no tracking at all)."""

    def __init__(self, sm: SpeedModel):
        from transformers import DynamicCache

        self.sm = sm
        self.cache = DynamicCache()
        self.true_len = 0

    @torch.inference_mode()
    def prefill(self, ids, is_image, pixel_values) -> torch.Tensor:
        b, n = ids.shape
        pos = torch.arange(n, device=ids.device).unsqueeze(0).expand(b, -1)
        out = self.sm.model(input_ids=ids, pixel_values=pixel_values, position_ids=pos, past_key_values=self.cache,
                            use_cache=True, logits_to_keep=1)
        self.true_len = n
        return out.logits[:, -1].argmax(dim=-1)

    @torch.inference_mode()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        b = tokens.shape[0]
        pos = torch.full((b, 1), self.true_len, device=tokens.device)
        out = self.sm.model(input_ids=tokens.view(-1, 1), position_ids=pos, past_key_values=self.cache,
                            use_cache=True, logits_to_keep=1)
        self.true_len += 1
        return out.logits[:, -1].argmax(dim=-1)

    def kv_bytes(self) -> int:
        total = 0
        for layer in self.cache.layers:
            if getattr(layer, "keys", None) is not None:
                total += layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()
        return total

    def kept_per_layer(self) -> list[int]:
        return [int(layer.keys.shape[-2]) if getattr(layer, "keys", None) is not None else 0
                for layer in self.cache.layers]


def new_run(sm: SpeedModel, method: str, budget: float, knobs: dict[str, Any] | None):
    if method == STOCK:
        return StockRun(sm)
    return BatchedRun(sm, make_policy(method, budget, **(knobs or {})), budget)


def run_timed(sm: SpeedModel, method: str, budget: float, knobs: dict | None, ids, is_image, pixels,
              gen_len: int) -> dict[str, Any]:
    """Prefill (timed: TTFT = forward + compression), then gen_len - 1 decode steps, each synchronised and
    timed (forward + the policy's compression). Rows of `ids` run as one batch."""
    run = new_run(sm, method, budget, knobs)
    ctx = tracked_attention_enabled(sm.model) if method != STOCK else _null()
    with ctx:
        sync(sm.device)
        t0 = time.perf_counter()
        tokens = run.prefill(ids, is_image, pixels)
        sync(sm.device)
        ttft = time.perf_counter() - t0
        generated = [tokens]
        steps = []
        for _ in range(gen_len - 1):
            t1 = time.perf_counter()
            tokens = run.step(tokens)
            sync(sm.device)
            steps.append(time.perf_counter() - t1)
            generated.append(tokens)
    return {"ttft_s": ttft, "step_s": steps, "tokens": torch.stack(generated, dim=1).tolist(),
            "kv_bytes": run.kv_bytes(), "kept_per_layer": run.kept_per_layer(),
            "true_len": ids.shape[1] + gen_len - 1, "extras": getattr(getattr(run, "policy", None), "extras",
                                                                        lambda: {})()}


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def prefixkv_fixed_ratios(sm: SpeedModel, budget: float, ids, is_image, pixels) -> list[float]:
    """Per-layer ratios from an online PrefixKV search on the first prompt (used as fixed, offline-style ratios
    for every row when the model has no calibrated configuration)."""
    run = BatchedRun(sm, make_policy("prefixkv", budget, mode="online"), budget)
    with tracked_attention_enabled(sm.model):
        run.prefill(ids[:1], is_image[:1], pixels[:1])
    return list(run.policy.layer_ratios)
