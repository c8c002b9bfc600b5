#!/bin/bash
# Packs what bench/gpu.py needs on a GPU machine with no internet and a 64 MiB limit per transfer
# (this workplace's lent device; README "GPU figures"), into two folders sent one after the other:
#   .gpu/carry1: the bundled Triton (tritonserver, Python backend, 3.12 stub, its libraries), the
#                service's Python packages for CPython 3.12 (numpy 1.26 for the stub), redis-server,
#                wrk and their libraries not in the device's image, and this checkout's generated
#                files (protocol stubs, the tokenizer);
#   .gpu/carry2: model.onnx with float16 weights (45 MB: the float32 file is over the limit with
#                anything else; embedsite_torch runs float16, so the GPU figures are the same), its
#                export.json with that file's checksum.
# For `bench/gpu.py --engines` (the GPU engines side by side), unless ENGINES=0:
#   .gpu/carry3: minilm's float16 export (`export_model --dtype float16`, a float16 ONNX graph that
#                ONNX Runtime and TensorRT run; the weights-only copy above is no valid graph), made
#                here into a scratch repository;
#   .gpu/carry4 and on: onnxruntime-gpu 1.31.1 for CPython 3.12 (its CUDA and TensorRT providers;
#                the device's image has the CUDA 13 and cuDNN 9 wheels it loads), 60 MiB a folder.
#   TensorRT is not carried: its libraries (about a gigabyte) come only from pypi.nvidia.com, which
#   this workplace cannot reach, so the tensorrt engine is refused at load there and its cells say why.
# Run here after `make setup`; bench/device/setup.sh unpacks them on the device, each folder once it
# has come (one carry a call: `carry` takes at most 64 MiB).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=.venv/bin/python
SITE=$($PY -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
OUT=.gpu
PLATFORM=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_35_x86_64
  --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
# In the device's image already (KINDS.md), in versions the service runs with.
PRESENT='^(uvloop|pyyaml|charset_normalizer|requests|certifi|python_dateutil|msgpack|six|packaging)-'
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
rm -rf "$OUT" && mkdir -p "$OUT/carry1" "$OUT/carry2" "$OUT/work/wheels" "$OUT/work/site" "$OUT/work/tools/bin" \
  "$OUT/work/tools/lib" "$OUT/work/tools/generated"

# Python packages: the serving requirements without what the benchmark does not run (onnxruntime,
# psycopg) or the image has (tokenizers), unpacked into one tree.
grep -vE '^(onnxruntime|psycopg|tokenizers)' requirements.txt > "$OUT/work/requirements.txt"
$PY -m pip download -q "${PLATFORM[@]}" -d "$OUT/work/wheels" -r "$OUT/work/requirements.txt"
for wheel in "$OUT"/work/wheels/*.whl; do
  basename "$wheel" | grep -qE "$PRESENT" || unzip -q -o "$wheel" -d "$OUT/work/site"
done
tar -C "$OUT/work/site" -cf - . | xz -9 -T0 > "$OUT/carry1/site.tar.xz"

# The Triton of the nvidia-pytriton wheel, as installed here (the wheel is the same for every Python):
# without the other Pythons' stubs and libpython.
tar -C "$SITE" -cf - --exclude='libpython3-*' pytriton/tritonserver/bin pytriton/tritonserver/backends \
  pytriton/tritonserver/python_backend_stubs/3.12 nvidia_pytriton.libs pytriton/__init__.py \
  | xz -9 -T0 > "$OUT/carry1/triton.tar.xz"

# Debian's redis-server and wrk, with the libraries the device's Ubuntu lacks.
cp "$(command -v redis-server)" "$(command -v wrk)" "$OUT/work/tools/bin/"
for lib in libluajit-5.1.so.2 liblzf.so.1 libjemalloc.so.2 libatomic.so.1; do
  cp -L "/lib/x86_64-linux-gnu/$lib" "$OUT/work/tools/lib/"
done
# Generated here by `make setup`, ignored by git, so not in the working tree that travels.
tar -cf - embeddings/triton/protocol/*_pb2*.py model_repository/minilm/1/tokenizer*.json \
  model_repository/minilm/1/special_tokens_map.json model_repository/minilm/1/vocab.txt \
  | tar -C "$OUT/work/tools/generated" -xf -
tar -C "$OUT/work/tools" -cf - . | xz -9 -T0 > "$OUT/carry1/tools.tar.xz"

# The model, float16 weights.
$PY bench/device/probe.py --make "$OUT/carry1/probe"
$PY - "$OUT/carry2" <<'PYTHON'
import hashlib, json, sys
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

target = Path(sys.argv[1])
version = Path("model_repository/minilm/1")
model = onnx.load(str(version / "model.onnx"))
for index, tensor in enumerate(model.graph.initializer):
    if tensor.data_type == onnx.TensorProto.FLOAT:
        half = numpy_helper.to_array(tensor).astype(np.float16)
        model.graph.initializer[index].CopyFrom(numpy_helper.from_array(half, tensor.name))
onnx.save(model, str(target / "model.onnx"))
info = json.loads((version / "export.json").read_text())
info["sha256_float32"] = info["sha256"]
info["sha256"] = hashlib.sha256((target / "model.onnx").read_bytes()).hexdigest()
info["carried_as"] = "float16 weights (bench/device/pack.sh)"
(target / "export.json").write_text(json.dumps(info, indent=2))
PYTHON
xz -9 -T0 "$OUT/carry2/model.onnx"
# The reference vectors bench/gpu.py checks the GPU's against (bench/gpu.py --write-reference).
if [ -f bench/results/gpu-reference.npz ]; then cp bench/results/gpu-reference.npz "$OUT/carry2/"; fi

if [ "${ENGINES:-1}" = 1 ]; then
  if $PY manage.py export_model --help | grep -q float16; then
    $PY manage.py export_model --name minilm --dtype float16 --version 2 --repository "$OUT/work/float16"
    mkdir -p "$OUT/carry3"
    tar -C "$OUT/work/float16/minilm/2" -cf "$OUT/carry3/float16-export.tar" --exclude=model.onnx .
    xz -9 -T0 -c "$OUT/work/float16/minilm/2/model.onnx" > "$OUT/carry3/model.onnx.xz"
  else
    echo "no float16 export carried: this checkout's export_model has no --dtype float16" >&2
  fi
  $PY -m pip download -q --no-deps "${PLATFORM[@]}" -d "$OUT/work/gpu-wheels" onnxruntime-gpu==1.31.1
  wheel=$(ls "$OUT"/work/gpu-wheels/onnxruntime_gpu-*.whl)
  split -b 60M -d -a 2 "$wheel" "$OUT/work/gpu-wheels/part"
  parts=("$OUT"/work/gpu-wheels/part*)
  for index in "${!parts[@]}"; do
    carry="$OUT/carry$((index + 4))"
    mkdir -p "$carry"
    mv "${parts[$index]}" "$carry/onnxruntime-gpu.part$(printf %02d "$index")"
    # Each folder says what the parts make, so setup.sh can tell when they are all there.
    printf '%s %s %s\n' "$(basename "$wheel")" "${#parts[@]}" "$(sha256sum "$wheel" | cut -d' ' -f1)" \
      > "$carry/onnxruntime-gpu.manifest"
  done
fi
rm -rf "$OUT/work"
du -sh "$OUT"/carry*
