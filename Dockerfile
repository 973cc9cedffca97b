# kvserve CPU image. Configure with environment variables, e.g.
#   docker build -t kvserve .
#   docker run --rm -p 8000:8000 -e KV_BACKEND=full kvserve
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 \
    HOST=0.0.0.0 PORT=8000 KV_BACKEND=full DEVICE=cpu

WORKDIR /app
# Dependencies first (cached layer), then the code and the bundled model.
# TORCH_INDEX_URL may point pip at a CPU-only torch index to keep the image small.
ARG TORCH_INDEX_URL=""
COPY pyproject.toml constraints.txt README.md ./
COPY server ./server
COPY cache_backends ./cache_backends
COPY bench ./bench
RUN if [ -n "$TORCH_INDEX_URL" ]; then pip install -c constraints.txt --index-url "$TORCH_INDEX_URL" torch; fi \
 && pip install -c constraints.txt .
COPY models ./models

RUN useradd --create-home --uid 10001 kvserve && chown -R kvserve /app
USER kvserve

ENV MODEL_ID=/app/models/kjv-llama-mha
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=5s --start-period=60s --retries=3 \
  CMD python -c "import os,urllib.request; urllib.request.urlopen(f'http://127.0.0.1:{os.environ.get(\"PORT\",\"8000\")}/health', timeout=4)" || exit 1
CMD ["kvserve", "serve"]
