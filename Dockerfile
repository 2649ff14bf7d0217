# The tierstore service image: CPU torch (a GPU host can swap in a CUDA torch + `.[gpu]`).
#   docker build -t tierstore .
#   docker run --rm -p 127.0.0.1:8080:8080 tierstore serve --host 0.0.0.0 --no-redis
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# CPU torch first, from the PyTorch CPU index: `pip install .` then finds torch satisfied and
# does not pull the multi-GiB CUDA wheels from PyPI. Its own layer, so code edits reuse it.
RUN pip install --index-url https://download.pytorch.org/whl/cpu torch

WORKDIR /src
COPY pyproject.toml README.md ./
COPY gpu_arena ./gpu_arena
COPY host_tier ./host_tier
COPY remote_tier ./remote_tier
COPY kernels ./kernels
COPY tierstore ./tierstore
RUN pip install . && rm -rf /src

RUN useradd --create-home --uid 10001 tierstore
USER tierstore
WORKDIR /home/tierstore

EXPOSE 8080
HEALTHCHECK --interval=10s --timeout=3s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8080/healthz', timeout=2)"]
ENTRYPOINT ["tierstore"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8080"]
