#!/bin/bash
# On the lent GPU machine (bench/device/pack.sh made what it unpacks): a virtualenv of the image's
# Python 3.12 holding the service's packages, numpy 1.26 before the image's numpy 2 (the Python
# backend stub needs the 1.x ABI) and the image's torch after them; the bundled Triton; redis-server
# and wrk; the generated files; the model; for `bench/gpu.py --engines`, the float16 export (in
# $GPU_HOME/exports/minilm: `--exports` names it) and onnxruntime-gpu, installed into the virtualenv
# once all its parts have come, ahead of the image's CPU onnxruntime. Each part is unpacked once,
# when its folder has come.
# Unpacks outside the checkout (/tmp/embedsite-gpu: the device's copy of the checkout drops files
# git does not know between calls) and writes its env.sh, which `source` before bench/gpu.py.
set -euo pipefail
cd "$(dirname "$0")/../.."
CARRIED=$PWD/.gpu
GPU=${GPU_HOME:-/tmp/embedsite-gpu}
IMAGE_PYTHON=${IMAGE_PYTHON:-$(command -v python3)}
VENV=$GPU/venv
IMAGE_SITE=$("$IMAGE_PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
mkdir -p "$GPU"
if [ -f "$CARRIED/carry1/site.tar.xz" ] && [ ! -f "$VENV/.unpacked" ]; then
  "$IMAGE_PYTHON" -m venv "$VENV"
  SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
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
if [ -f "$CARRIED/carry3/float16-export.tar" ] && [ ! -f "$GPU/exports/minilm/2/model.onnx" ]; then
  mkdir -p "$GPU/exports/minilm/2"
  tar -C "$GPU/exports/minilm/2" -xf "$CARRIED/carry3/float16-export.tar"
  xz -dc "$CARRIED/carry3/model.onnx.xz" > "$GPU/exports/minilm/2/model.onnx.partial"
  mv "$GPU/exports/minilm/2/model.onnx.partial" "$GPU/exports/minilm/2/model.onnx"
fi
# onnxruntime-gpu's parts, kept as they come (one folder a call); joined, checked and unpacked into
# the virtualenv once all are here.
for carried in "$CARRIED"/carry*/onnxruntime-gpu.manifest; do
  [ -f "$carried" ] || continue
  mkdir -p "$GPU/parts" && cp "$(dirname "$carried")"/onnxruntime-gpu.* "$GPU/parts/"
done
if [ -f "$GPU/parts/onnxruntime-gpu.manifest" ] && [ -f "$VENV/.unpacked" ] && [ ! -f "$VENV/.onnxruntime-gpu" ]; then
  read -r WHEEL PARTS SHA256 < "$GPU/parts/onnxruntime-gpu.manifest"
  HAVE=$(ls "$GPU"/parts/onnxruntime-gpu.part* | wc -l)
  if [ "$HAVE" = "$PARTS" ]; then
    cat "$GPU"/parts/onnxruntime-gpu.part* > "$GPU/$WHEEL"
    echo "$SHA256  $GPU/$WHEEL" | sha256sum -c --quiet
    SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    unzip -q -o "$GPU/$WHEEL" -d "$SITE" && rm -f "$GPU/$WHEEL" && touch "$VENV/.onnxruntime-gpu"
  else
    echo "onnxruntime-gpu: $HAVE of $PARTS parts here; carry the others"
  fi
fi
# Into the checkout on every call (ignored files there may be gone): the generated files, the model.
cp -r "$GPU/tools/generated/." .
if [ -f "$GPU/model/model.onnx" ]; then
  cp "$GPU/model/model.onnx" "$GPU/model/export.json" model_repository/minilm/1/
  if [ -f "$GPU/model/gpu-reference.npz" ]; then mkdir -p bench/results && cp "$GPU/model/gpu-reference.npz" bench/results/; fi
fi
# The image's CUDA 13 and cuDNN wheels' libraries, where onnxruntime-gpu's providers find them.
NVIDIA_LIBS=$(ls -d "$IMAGE_SITE"/nvidia/*/lib 2>/dev/null | paste -sd: || true)
cat > "$GPU/env.sh" <<ENV
export PATH="$VENV/bin:$GPU/tools/bin:\$PATH"
export LD_LIBRARY_PATH="$GPU/tools/lib${NVIDIA_LIBS:+:$NVIDIA_LIBS}\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
export DJANGO_SECRET_KEY="$(python3 -c 'import secrets; print(secrets.token_urlsafe(64))')"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
ENV
echo "setup done: $(ls "$GPU")"
