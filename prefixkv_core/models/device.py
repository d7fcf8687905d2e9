"""Turn the user's device and dtype strings into torch objects, and move a model onto them."""
from __future__ import annotations

import re

import torch

DEVICES_ACCEPTED = "auto, auto-multi, cpu, cuda, cuda:N"
DTYPES_ACCEPTED = "auto, float32, float16, bfloat16 (aliases: fp32, fp16, half, bf16)"
_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def resolve_device(device: str) -> tuple[torch.device, bool]:
    """Return (device, use_device_map_auto)."""
    if not isinstance(device, str):
        if isinstance(device, torch.device):
            device = str(device)
        else:
            raise ValueError(f"device must be a string; accepted: {DEVICES_ACCEPTED}")
    d = device.strip().lower()
    n_gpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if d == "auto":
        if n_gpu > 1:
            return torch.device("cuda:0"), True
        return torch.device("cuda" if n_gpu else "cpu"), False
    if d == "auto-multi":
        return torch.device("cuda:0" if n_gpu else "cpu"), True
    if d == "cpu":
        return torch.device("cpu"), False
    m = re.fullmatch(r"cuda(?::(\d+))?", d)
    if m:
        if not n_gpu:
            raise ValueError(f"device {device!r} requested but CUDA is not available; accepted: {DEVICES_ACCEPTED}")
        idx = int(m.group(1) or 0)
        if idx >= n_gpu:
            raise ValueError(f"device {device!r}: only {n_gpu} CUDA device(s) present; accepted: {DEVICES_ACCEPTED}")
        return torch.device(f"cuda:{idx}"), False
    raise ValueError(f"unknown device {device!r}; accepted: {DEVICES_ACCEPTED}")


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if not isinstance(dtype, str):
        raise ValueError(f"dtype must be a string; accepted: {DTYPES_ACCEPTED}")
    d = dtype.strip().lower().replace("torch.", "")
    if d == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if d in _DTYPES:
        return _DTYPES[d]
    raise ValueError(f"unknown dtype {dtype!r}; accepted: {DTYPES_ACCEPTED}")


def avoid_cudnn_attention(device: torch.device) -> None:
    """On CUDA, take cuDNN out of PyTorch's SDPA backends (flash and memory-efficient attention remain). Why: on
    Hopper, torch picks cuDNN attention first, and cuDNN builds a new execution graph for every new key length
    (an H200 with torch 2.11: ~60 ms per new length, 0.2 ms once built). A decode step meets a new length at
    every token, and one per layer when layers keep different counts (PyramidKV: ~1.4 s a step), so decode
    timings measured graph builds, not attention. Process-wide, so the stock baseline runs the same kernels."""
    if torch.device(device).type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)


def place_model(model, device: torch.device, dtype: torch.dtype):
    """Cast first, then move: a float32 model reaches the GPU already in its smaller dtype."""
    model = model.to(dtype=dtype)
    return model.to(device)


def instantiate(cls, config, device: torch.device, dtype: torch.dtype, seed: int):
    """A model of class `cls` built from `config` with seeded random weights, created on `device` in `dtype`, in
    eval mode without gradients (the random-weight shapes of the speed benchmarks)."""
    avoid_cudnn_attention(device)  # decode timings would measure cuDNN's graph builds (see there)
    torch.manual_seed(seed)
    with torch.device(device):
        model = cls._from_config(config, dtype=dtype, attn_implementation="sdpa")
    model.eval()
    model.requires_grad_(False)
    return model
