# syntax=docker/dockerfile:1
# iga-ds on NVIDIA's PyTorch container (NGC): torch, CUDA and NCCL from the base image,
# DeepSpeed without prebuilt ops (the trainer's optimizer is torch's AdamW, so no rank needs
# DeepSpeed's fused Adam), a non-root user, and the base image's own entrypoint (its driver
# checks) in front of every command. CI does not build this image (no Docker engine there);
# see docs/CLUSTER.md.
#
# No cache variable (HF_HOME, TRITON_CACHE_DIR, TORCH_EXTENSIONS_DIR, XDG_CACHE_HOME) is set
# here: Apptainer and pyxis keep a variable the image sets over the host's, which would send the
# first Triton compile into the read-only image. The launchers set them (slurm/job_lib.sh,
# launch/docker_run.sh); unset, each tool uses its default under $HOME.
#
#   docker build -t iga-ds:0.1.0 .
#   docker build --build-arg NGC_PYTORCH_TAG=25.01-py3 -t iga-ds:0.1.0 .
#   docker run --rm --gpus all --ipc=host --user "$(id -u):$(id -g)" -v "$PWD:/workspace" \
#       -v "$HOME/.cache/iga-ds:/cache" -e XDG_CACHE_HOME=/cache iga-ds:0.1.0 iga-ds selfcheck

# The base image and its tag (tag@sha256:digest also works, for a byte-exact rebuild).
ARG NGC_PYTORCH_TAG=25.01-py3
FROM nvcr.io/nvidia/pytorch:${NGC_PYTORCH_TAG}

# Versions pinned here and in docker/constraints.txt.
ARG DEEPSPEED_VERSION=0.19.8
ARG IGA_UID=1000
ARG IGA_GID=1000

ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    TOKENIZERS_PARALLELISM=false \
    NCCL_NVLS_ENABLE=0 \
    TORCH_NCCL_ASYNC_ERROR_HANDLING=1 \
    NCCL_ASYNC_ERROR_HANDLING=1

WORKDIR /opt/iga-ds
COPY docker/constraints.txt docker/constraints.txt

# DeepSpeed first, against the base image's torch (no build isolation), no op compiled: the
# trainer steps torch's AdamW. A site that wants an op prebuilt adds DS_BUILD_<OP>=1 here.
RUN IGA_BASE_TORCH_VERSION="$(python -c 'import torch; print(torch.__version__)')" \
    && export IGA_BASE_TORCH_VERSION \
    && DS_BUILD_OPS=0 pip install --no-build-isolation -c docker/constraints.txt "deepspeed==${DEEPSPEED_VERSION}"

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

# Non-root user; /cache and /workspace are mount points (launch/docker_run.sh), writable by it
# and by any --user a cluster maps in (sticky like /tmp).
RUN groupadd --gid "${IGA_GID}" iga 2>/dev/null || true \
    && useradd --uid "${IGA_UID}" --gid "${IGA_GID}" --create-home --shell /bin/bash iga \
    && mkdir -p /cache /workspace \
    && chmod 1777 /cache /workspace
USER iga
WORKDIR /workspace

# CMD, not ENTRYPOINT: the base image's entrypoint runs first and then this (or the command
# given to `docker run`), e.g. `docker run ... iga-ds:0.1.0 iga-ds selfcheck`.
CMD ["iga-ds", "--help"]
