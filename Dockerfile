# syntax=docker/dockerfile:1
# iga-ds on NVIDIA's PyTorch container (NGC): torch, CUDA and NCCL from the base image,
# DeepSpeed with its fused Adam op built for H100 (sm_90) at image build, a non-root user, and
# caches on writable paths. CI does not build this image (no Docker engine there); see
# docs/CLUSTER.md.
#
#   docker build -t iga-ds:0.1.0 .
#   docker build --build-arg NGC_PYTORCH_TAG=25.01-py3 --build-arg TORCH_CUDA_ARCH_LIST="8.0;9.0" -t iga-ds:0.1.0 .
#   docker run --rm --gpus all --ipc=host --user "$(id -u):$(id -g)" -v "$PWD:/workspace" \
#       -v "$HOME/.cache/iga-ds:/cache" iga-ds:0.1.0 selfcheck

# The base image and its tag (tag@sha256:digest also works, for a byte-exact rebuild).
ARG NGC_PYTORCH_TAG=25.01-py3
FROM nvcr.io/nvidia/pytorch:${NGC_PYTORCH_TAG}

# Versions pinned here and in docker/constraints.txt; compute capability 9.0 is H100/H200.
ARG DEEPSPEED_VERSION=0.19.8
ARG TORCH_CUDA_ARCH_LIST=9.0
ARG IGA_UID=1000
ARG IGA_GID=1000

ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    TOKENIZERS_PARALLELISM=false \
    HF_HOME=/cache/huggingface \
    TORCH_EXTENSIONS_DIR=/cache/torch_extensions \
    TRITON_CACHE_DIR=/cache/triton \
    XDG_CACHE_HOME=/cache \
    NCCL_NVLS_ENABLE=0 \
    TORCH_NCCL_ASYNC_ERROR_HANDLING=1 \
    NCCL_ASYNC_ERROR_HANDLING=1

WORKDIR /opt/iga-ds
COPY docker/constraints.txt docker/constraints.txt

# DeepSpeed first, compiled against the base image's torch (no build isolation) with fused Adam
# prebuilt, so no rank JIT-compiles it at start-up; the check fails the build if it was not built.
RUN IGA_BASE_TORCH_VERSION="$(python -c 'import torch; print(torch.__version__)')" \
    && export IGA_BASE_TORCH_VERSION \
    && DS_BUILD_OPS=0 DS_BUILD_FUSED_ADAM=1 TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST}" \
       pip install --no-build-isolation -c docker/constraints.txt "deepspeed==${DEEPSPEED_VERSION}" \
    && python -c "from deepspeed.git_version_info import installed_ops as ops; assert ops.get('fused_adam'), ops"

COPY pyproject.toml README.md ./
COPY iga_ds iga_ds
COPY launch launch
COPY slurm slurm
COPY configs configs
COPY ds_configs ds_configs
RUN IGA_BASE_TORCH_VERSION="$(python -c 'import torch; print(torch.__version__)')" \
    && export IGA_BASE_TORCH_VERSION \
    && pip install --no-build-isolation -c docker/constraints.txt ".[mpi]" \
    && python -c "import torch, iga_ds; print('torch', torch.__version__, 'iga-ds', iga_ds.__version__)"

# Non-root user; caches writable by it and by any --user a cluster maps in (sticky like /tmp).
RUN groupadd --gid "${IGA_GID}" iga 2>/dev/null || true \
    && useradd --uid "${IGA_UID}" --gid "${IGA_GID}" --create-home --shell /bin/bash iga \
    && mkdir -p /cache/huggingface /cache/torch_extensions /cache/triton /workspace \
    && chmod 1777 /cache /cache/huggingface /cache/torch_extensions /cache/triton /workspace
USER iga
WORKDIR /workspace

ENTRYPOINT ["iga-ds"]
CMD ["--help"]
