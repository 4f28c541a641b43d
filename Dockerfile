# plugserve on an NVIDIA GPU machine, serving the embedded model unless told otherwise:
#   docker build -t plugserve .
#   docker run --gpus all -p 30000:30000 -v /models:/models -v plugserve-cache:/root/.cache plugserve \
#       --model-path /models/DeepSeek-V3 --tp 8
# The cache volume keeps Triton's, FlashInfer's and torch.compile's compiled kernels across restarts.
# Build arguments: CUDA_IMAGE (the base), TORCH_INDEX (the PyTorch wheel index of its CUDA), EXTRAS (pyproject's).
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-devel-ubuntu24.04
FROM ${CUDA_IMAGE}
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128
ARG EXTRAS=flashinfer,cutlass

RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev build-essential \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1
# torch first, from the index of the base image's CUDA: PyPI's default build may target another one.
RUN pip install --no-cache-dir --upgrade pip && pip install --no-cache-dir torch --index-url ${TORCH_INDEX}

WORKDIR /opt/plugserve
COPY pyproject.toml README.md LICENSE ./
COPY plugserve ./plugserve
RUN pip install --no-cache-dir ".[${EXTRAS}]"

EXPOSE 30000
HEALTHCHECK --interval=10s --timeout=3s --start-period=600s \
    CMD python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:30000/health')"
ENTRYPOINT ["plugserve", "serve", "--host", "0.0.0.0", "--port", "30000"]
