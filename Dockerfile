# kvserve image: CPU-only by default, a CUDA variant by build argument. Configure with environment variables:
#   docker build -t kvserve .
#   docker run --rm -p 8000:8000 -e KV_BACKEND=int8 kvserve
# Calibration shipped in the image (optional): the gqa/mla/dca fits made at build time by `kvserve calibrate`,
# so a container serving those backends starts without calibrating (pass the run's KV_MLA_RANK/KV_GQA_GROUPS
# too, when set; they select the fit):
#   docker build --build-arg CALIBRATE="gqa mla dca" --build-arg KV_MLA_RANK=64 -t kvserve .
# CUDA variant: the same Dockerfile with a CUDA torch. PyPI's Linux torch wheel is the CUDA build and brings
# the CUDA runtime as nvidia-* wheels (a PyTorch index such as https://download.pytorch.org/whl/cu128 picks
# a CUDA version); the host needs the NVIDIA driver and container toolkit. DEVICE=auto uses the GPU:
#   docker build --build-arg TORCH_INDEX_URL=https://pypi.org/simple -t kvserve:cuda .
#   docker run --rm --gpus all -p 8000:8000 kvserve:cuda
# Works with the classic builder and BuildKit (no BuildKit-only syntax).
ARG PYTHON_IMAGE=python:3.11-slim

# ---- build stage: a virtual environment with torch, the dependencies and kvserve; pip runs only here ----
FROM ${PYTHON_IMAGE} AS build
# Where torch comes from: PyTorch's CPU-only wheel index unless overridden (see the CUDA variant above).
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
RUN python3 -m venv /opt/kvserve
ENV PATH=/opt/kvserve/bin:$PATH
WORKDIR /src
# Each layer copies only what it needs, so that editing the code or the README keeps the dependency layers.
COPY constraints.txt ./
# torch alone from TORCH_INDEX_URL, pinned by constraints.txt. An empty argument (docker-compose v1 passes
# unset ones as "") means the default.
RUN pip install -c constraints.txt --index-url "${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}" torch
# The other dependencies, read from pyproject.toml.
COPY pyproject.toml ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
      > /tmp/requirements.txt \
 && pip install -c constraints.txt -r /tmp/requirements.txt
COPY README.md ./
COPY server ./server
COPY cache_backends ./cache_backends
COPY bench ./bench
# kvserve's attention kernel (cache_backends/kernels) is compiled here, with this stage's g++, into
# /opt/kvserve/kernels, which the runtime stage loads without a compiler; if it cannot be built, the torch path
# serves and /info's kv_attention says why. torch's C++ headers and test binaries serve only to compile
# extensions and test torch itself; the runtime image has no compiler, so they go after the build (about 190 MB
# of the CPU wheel).
ENV KVSERVE_KERNELS_DIR=/opt/kvserve/kernels
RUN pip install --no-deps . \
 && { { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends g++ \
        >/dev/null && python -m cache_backends.kernels build; } \
      || echo "kvserve: the attention kernel was not built; the torch path will serve"; } \
 && T="$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/torch" \
 && rm -rf "$T/include" "$T/test" \
 && find "$T/bin" -maxdepth 1 -type f \( -name '*Test' -o -name 'test_*' -o -name 'protoc*' \) -delete \
 && find /opt/kvserve -name __pycache__ -prune -exec rm -rf {} +

# ---- runtime stage: the venv and the model; no pip caches, no build tools, no sources ----
FROM ${PYTHON_IMAGE}
ENV PATH=/opt/kvserve/bin:$PATH PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 KVSERVE_KERNELS_DIR=/opt/kvserve/kernels \
    HOST=0.0.0.0 PORT=8000 KV_BACKEND=full DEVICE=auto MODEL_ID=/app/models/kjv-llama-mha \
    KV_CALIBRATION_CACHE_DIR=/app/calibration
RUN useradd --create-home --uid 10001 --user-group kvserve \
 && mkdir -p /app/calibration && chown 10001:10001 /app/calibration
COPY --from=build /opt/kvserve /opt/kvserve
COPY models /app/models
WORKDIR /app
USER 10001:10001
# Backends whose fits the image ships (space or comma separated; e.g. "gqa mla dca"): empty by default, as the
# default KV_BACKEND (full) fits nothing, a default build stays as fast as before, and a larger model's
# calibration is worth running where its hardware is. The fits are keyed by the backend parameters that
# change them (KV_MLA_RANK, KV_GQA_GROUPS: give the values the containers will run with, or they refit at
# start) and are device/dtype independent: fitted here on the CPU in float32, they serve a CUDA bfloat16 run.
ARG CALIBRATE=
ARG KV_MLA_RANK=
ARG KV_GQA_GROUPS=
# (unquoted on purpose: each word is one --backend value; a comma list is split by kvserve calibrate)
RUN if [ -n "$CALIBRATE" ]; then kvserve calibrate --backend $CALIBRATE; fi
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \
  CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen(f'http://127.0.0.1:{os.environ.get(\"PORT\", \"8000\")}/health', timeout=4)"]
CMD ["kvserve", "serve"]
