#!/bin/bash
# On the lent GPU machine (bench/device/pack.sh made what it unpacks): a virtualenv of the image's
# Python 3.12 holding the service's packages, numpy 1.26 before the image's numpy 2 (the Python
# backend stub needs the 1.x ABI) and the image's torch after them; the bundled Triton; redis-server
# and wrk; the generated files; the model. Each part is unpacked once, when its folder has come.
# Unpacks outside the checkout (/tmp/embedsite-gpu: the device's copy of the checkout drops files
# git does not know between calls) and writes its env.sh, which `source` before bench/gpu.py.
set -euo pipefail
cd "$(dirname "$0")/../.."
CARRIED=$PWD/.gpu
GPU=${GPU_HOME:-/tmp/embedsite-gpu}
IMAGE_PYTHON=${IMAGE_PYTHON:-$(command -v python3)}
VENV=$GPU/venv
mkdir -p "$GPU"
if [ -f "$CARRIED/carry1/site.tar.xz" ] && [ ! -f "$VENV/.unpacked" ]; then
  "$IMAGE_PYTHON" -m venv "$VENV"
  SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  IMAGE_SITE=$("$IMAGE_PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  tar -C "$SITE" -xJf "$CARRIED/carry1/site.tar.xz"
  tar -C "$SITE" -xJf "$CARRIED/carry1/triton.tar.xz"
  # After this venv's own packages: torch and the rest of the image.
  echo "$IMAGE_SITE" > "$SITE/zz-image-packages.pth"
  mkdir -p "$GPU/tools" && tar -C "$GPU/tools" -xJf "$CARRIED/carry1/tools.tar.xz"
  cp -r "$CARRIED/carry1/probe" "$GPU/probe"
  touch "$VENV/.unpacked"
fi
if [ -f "$CARRIED/carry2/model.onnx.xz" ] && [ ! -f "$GPU/model/model.onnx" ]; then
  mkdir -p "$GPU/model"
  xz -dc "$CARRIED/carry2/model.onnx.xz" > "$GPU/model/model.onnx.partial"
  cp "$CARRIED/carry2/export.json" "$GPU/model/export.json"
  if [ -f "$CARRIED/carry2/gpu-reference.npz" ]; then cp "$CARRIED/carry2/gpu-reference.npz" "$GPU/model/"; fi
  mv "$GPU/model/model.onnx.partial" "$GPU/model/model.onnx"
fi
# Into the checkout on every call (ignored files there may be gone): the generated files, the model.
cp -r "$GPU/tools/generated/." .
if [ -f "$GPU/model/model.onnx" ]; then
  cp "$GPU/model/model.onnx" "$GPU/model/export.json" model_repository/minilm/1/
  if [ -f "$GPU/model/gpu-reference.npz" ]; then mkdir -p bench/results && cp "$GPU/model/gpu-reference.npz" bench/results/; fi
fi
cat > "$GPU/env.sh" <<ENV
export PATH="$VENV/bin:$GPU/tools/bin:\$PATH"
export LD_LIBRARY_PATH="$GPU/tools/lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
export DJANGO_SECRET_KEY="$(python3 -c 'import secrets; print(secrets.token_urlsafe(64))')"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
ENV
echo "setup done: $(ls "$GPU")"
