# syntax=docker/dockerfile:1
# OmniFlow's image: the flows, their tasks and the `omniflow` command, for docker / Kubernetes work pools
# (deployments/definitions.py) and Ray cluster pods. One file, two variants:
#
#   docker build -t omniflow:cpu .                              # torch from the CPU wheel index
#   docker build --build-arg VARIANT=cuda -t omniflow:cuda .    # torch built for CUDA 12.8 (its CUDA libraries
#                                                               # come as wheels; the host needs the NVIDIA driver
#                                                               # and the NVIDIA container toolkit)
#   docker build --build-arg VARIANT=cuda \
#       --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126 -t omniflow:cuda126 .
#
# A docker worker runs each flow run as `prefect flow-run execute` in a container of this image (the command
# the worker sets replaces CMD); relative paths of the parameters resolve in WORKDIR.
ARG PYTHON_VERSION=3.11
FROM python:${PYTHON_VERSION}-slim-bookworm

ARG VARIANT=cpu
ARG TORCH_VERSION=2.13.0
# Empty: the index of VARIANT (cpu: .../whl/cpu, cuda: .../whl/cu128). Set it to pick another CUDA build.
ARG TORCH_INDEX_URL=""

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    DO_NOT_TRACK=1 \
    RAY_USAGE_STATS_ENABLED=0 \
    PREFECT_SERVER_ANALYTICS_ENABLED=false \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# torch first, from the wheel index of the variant: PyPI's default torch is a CUDA build of its own choosing,
# and OmniFlow's requirement (torch>=2.4) keeps whichever torch is installed.
RUN case "${VARIANT}" in \
        cpu) default_index=https://download.pytorch.org/whl/cpu ;; \
        cuda) default_index=https://download.pytorch.org/whl/cu128 ;; \
        *) echo "VARIANT=${VARIANT}: must be cpu or cuda" >&2; exit 1 ;; \
    esac \
    && pip install --no-cache-dir --index-url "${TORCH_INDEX_URL:-${default_index}}" "torch==${TORCH_VERSION}"

# OmniFlow in place (editable), as in the repository: deployment runs may import the reward files of its
# examples/rewards, which a site-packages install would leave behind.
WORKDIR /opt/omniflow
COPY pyproject.toml README.md ./
COPY omni_core ./omni_core
COPY flows ./flows
COPY tasks ./tasks
COPY deployments ./deployments
COPY examples ./examples
RUN pip install --no-cache-dir --editable . \
    && python -c "import torch, omniflow.flows.cli; print('torch', torch.__version__)"

# Not root: the flow runs, Ray and Prefect as user omniflow, in a work folder it owns (a docker deployment
# mounts its named volume there, so models, checkpoints and results outlive the container).
RUN useradd --create-home --uid 1000 --shell /bin/bash omniflow \
    && mkdir -p /home/omniflow/work \
    && chown omniflow:omniflow /home/omniflow/work
# Numeric, so that Kubernetes can check runAsNonRoot.
USER 1000:1000
WORKDIR /home/omniflow/work

CMD ["omniflow", "--help"]
