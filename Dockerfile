# syntax=docker/dockerfile:1
# iga-ds on NVIDIA's PyTorch container (NGC): torch, CUDA and NCCL from the base image,
# DeepSpeed without prebuilt ops (the trainer's optimizer is torch's AdamW, so no rank needs
# DeepSpeed's fused Adam), a non-root user, and the base image's own entrypoint (its driver
# checks) in front of every command. CI builds and runs it with podman on a stand-in base made
# from Debian's packages (docker/standin-base.sh, tests/launch/test_container_image.py); see
# docs/DOCKER.md.
#
# No cache variable (HF_HOME, TRITON_CACHE_DIR, TORCH_EXTENSIONS_DIR, XDG_CACHE_HOME) is set
# here: Apptainer and pyxis keep a variable the image sets over the host's, which would send the
# first Triton compile into the read-only image. The launchers set them (slurm/job_lib.sh,
# launch/docker_run.sh); unset, each tool uses its default under $HOME.
#
#   docker build -t iga-ds:0.1.0 .
#   docker build --build-arg NGC_PYTORCH_TAG=25.01-py3 -t iga-ds:0.1.0 .
#   podman build --build-arg BASE_IMAGE=localhost/iga-ds-standin-base:bookworm-1 \
#       --build-arg TORCH_VERSION=2.13.0+cpu --build-arg IGA_EXTRAS= \
#       --build-arg PIP_FIND_LINKS=/wheels --build-arg PIP_NO_INDEX=1 -v "$WHEELS:/wheels:ro" -t iga-ds:cpu .
#   docker run --rm --gpus all --ipc=host --user "$(id -u):$(id -g)" -v "$PWD:/workspace" \
#       -v "$HOME/.cache/iga-ds:/cache" -e XDG_CACHE_HOME=/cache iga-ds:0.1.0 iga-ds selfcheck

# The base image and its tag (tag@sha256:digest also works, for a byte-exact rebuild).
# BASE_IMAGE replaces the whole base: CI's stand-in (docker/standin-base.sh) has Python and pip
# on PATH but no torch, so it comes with TORCH_VERSION.
ARG NGC_PYTORCH_TAG=25.01-py3
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:${NGC_PYTORCH_TAG}
FROM ${BASE_IMAGE}

# Versions pinned here and in docker/constraints.txt.
ARG DEEPSPEED_VERSION=0.19.8
ARG IGA_UID=1000
ARG IGA_GID=1000
# Empty: keep the base image's torch (NGC). A base without torch names the build to install,
# e.g. 2.13.0+cpu (a CPU build: no CUDA package is pulled).
ARG TORCH_VERSION=
# Extras of the package: mpi (mpi4py) builds against the base image's MPI; a base without MPI
# (the stand-in) leaves it empty.
ARG IGA_EXTRAS=mpi
# Where pip looks, read by pip from the environment as they are: unset, PyPI. CI points
# PIP_FIND_LINKS at a wheelhouse mounted for the build (podman build -v) with PIP_NO_INDEX=1.
ARG PIP_FIND_LINKS
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ARG PIP_NO_INDEX

ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    TOKENIZERS_PARALLELISM=false \
    NCCL_NVLS_ENABLE=0 \
    TORCH_NCCL_ASYNC_ERROR_HANDLING=1 \
    NCCL_ASYNC_ERROR_HANDLING=1

# Non-root user; /cache and /workspace are mount points (launch/docker_run.sh), writable by it
# and by any --user a cluster maps in (sticky like /tmp).
RUN groupadd --gid "${IGA_GID}" iga 2>/dev/null || true \
    && useradd --uid "${IGA_UID}" --gid "${IGA_GID}" --create-home --shell /bin/bash iga \
    && mkdir -p /cache /workspace \
    && chmod 1777 /cache /workspace

WORKDIR /opt/iga-ds
COPY docker/constraints.txt docker/constraints.txt

# Layers from the least to the most often changed, so that a change to the sources reinstalls
# only the package: torch (if the base has none) and DeepSpeed, then the dependencies named in
# pyproject.toml, then the package itself without its dependencies.
# DeepSpeed against the base image's torch (no build isolation), no op compiled: the trainer
# steps torch's AdamW. A site that wants an op prebuilt adds DS_BUILD_<OP>=1 here.
RUN if [ -n "${TORCH_VERSION}" ]; then \
        IGA_BASE_TORCH_VERSION="${TORCH_VERSION}" pip install -c docker/constraints.txt torch setuptools wheel; \
    fi \
    && IGA_BASE_TORCH_VERSION="$(python -c 'import torch; print(torch.__version__)')" \
    && export IGA_BASE_TORCH_VERSION \
    && DS_BUILD_OPS=0 pip install --no-build-isolation -c docker/constraints.txt "deepspeed==${DEEPSPEED_VERSION}"

COPY pyproject.toml pyproject.toml
RUN IGA_BASE_TORCH_VERSION="$(python -c 'import torch; print(torch.__version__)')" \
    && export IGA_BASE_TORCH_VERSION \
    && python -c "import sys, tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; extras = [e for e in sys.argv[1].split(',') if e]; print('\n'.join(p['dependencies'] + [d for e in extras for d in p['optional-dependencies'][e]]))" "${IGA_EXTRAS}" >/tmp/iga-requirements.txt \
    && pip install -c docker/constraints.txt -r /tmp/iga-requirements.txt \
    && rm /tmp/iga-requirements.txt

COPY README.md README.md
COPY iga_ds iga_ds
COPY launch launch
COPY slurm slurm
COPY configs configs
COPY ds_configs ds_configs
RUN IGA_BASE_TORCH_VERSION="$(python -c 'import torch; print(torch.__version__)')" \
    && export IGA_BASE_TORCH_VERSION \
    && pip install --no-build-isolation --no-deps -c docker/constraints.txt . \
    && python -c "import torch, iga_ds; print('torch', torch.__version__, 'iga-ds', iga_ds.__version__)"

USER iga
WORKDIR /workspace

# CMD, not ENTRYPOINT: the base image's entrypoint runs first and then this (or the command
# given to `docker run`), e.g. `docker run ... iga-ds:0.1.0 iga-ds selfcheck`.
CMD ["iga-ds", "--help"]
