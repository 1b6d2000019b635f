#!/usr/bin/env bash
# Compile flash-attn's CUDA sources into object files on a machine without a GPU, with
# NVIDIA's CUDA compiler from PyPI, so that a GPU machine only compiles flash_api.cpp and
# links (about 20 s there instead of about 10 minutes). See docs/architecture.md,
# "Attention with FlashAttention".
#
#   tools/flash_attn/build_objects.sh OUT_DIR [TORCH_VERSION] [CUDA_VERSION] [SM]
#
# TORCH_VERSION (default 2.11.0) and CUDA_VERSION (13.0) must be the GPU machine's (its
# torch headers and nvcc); SM (90: H100 and H200) its compute capability. Forward kernels
# only (no backward, dropout, ALiBi or soft-capping: inference needs none of them).
# OUT_DIR/fa.tar.xz then holds the objects, flash-attn's Python package and the headers
# flash_api.cpp needs; link.py builds the module from it. On 2 cores: about 45 minutes.
set -euo pipefail
OUT=$(realpath -m "$1"); TORCH=${2:-2.11.0}; CUDA=${3:-13.0}; SM=${4:-90}
FA=2.8.3.post2
PY=${PYTHON:-python3}
mkdir -p "$OUT" && cd "$OUT"
case "$CUDA" in
  13.0) NVCC=13.0.88 RUNTIME=13.0.96 CCCL=13.0.85 ;;
  *) echo "add the nvidia-cuda-* versions of CUDA $CUDA here" >&2; exit 1 ;;
esac
[ -d cuda ] || $PY -m pip install -q --no-deps --target cuda "nvidia-cuda-nvcc==$NVCC" "nvidia-cuda-crt==$NVCC" \
  "nvidia-nvvm==$NVCC" "nvidia-cuda-runtime==$RUNTIME" "nvidia-cuda-cccl==$CCCL"
[ -d torch-site ] || $PY -m pip install -q --no-deps --target torch-site "torch==$TORCH"
if [ ! -d "flash_attn-$FA" ]; then  # the sdist (pip download would try to build it)
  url=$(curl -fsS https://pypi.org/simple/flash-attn/ | grep -o "https://[^\"#]*flash_attn-$FA.tar.gz" | head -1)
  curl -fsS "$url" | tar xz
fi
C=$OUT/cuda/nvidia/cu13 T=$OUT/torch-site/torch S=$OUT/flash_attn-$FA
export PATH=$C/bin:$C/nvvm/bin:$PATH LD_LIBRARY_PATH=$C/lib:${LD_LIBRARY_PATH:-}
mkdir -p obj
compile() {  # flash-attn's setup.py flags, one architecture, the inference-only switches on
  local o="$OUT/obj/$(basename "$1" .cu).o"
  [ -s "$o" ] && return 0
  nvcc -I"$S/csrc/flash_attn" -I"$S/csrc/flash_attn/src" -I"$S/csrc/cutlass/include" -I"$T/include" \
    -I"$T/include/torch/csrc/api/include" -I"$C/include" -isystem "$C/include/cccl" -c "$1" -o "$o.tmp" \
    -O3 -std=c++17 --expt-relaxed-constexpr --expt-extended-lambda --use_fast_math --compiler-options -fPIC \
    -DFLASHATTENTION_DISABLE_BACKWARD -DFLASHATTENTION_DISABLE_DROPOUT -DFLASHATTENTION_DISABLE_ALIBI \
    -DFLASHATTENTION_DISABLE_SOFTCAP -gencode "arch=compute_$SM,code=sm_$SM" \
    -DTORCH_API_INCLUDE_EXTENSION_H -DTORCH_EXTENSION_NAME=flash_attn_2_cuda -D_GLIBCXX_USE_CXX11_ABI=1 \
    2>> "$OUT/nvcc.log"
  mv "$o.tmp" "$o" && echo "$(date +%T) $(basename "$o")"
}
export -f compile; export OUT C T S SM
ls "$S"/csrc/flash_attn/src/flash_*_sm80.cu | xargs -P "${JOBS:-$(nproc)}" -I{} bash -c 'compile {}'
rm -rf pack && mkdir -p pack/src/csrc/flash_attn/src pack/src/csrc/cutlass
cp -r obj pack/ && cp -r "$S/flash_attn" pack/src/ && cp "$S"/csrc/flash_attn/*.cpp pack/src/csrc/flash_attn/
cp "$S"/csrc/flash_attn/src/*.h "$S"/csrc/flash_attn/src/*.cuh pack/src/csrc/flash_attn/src/
cp -r "$S/csrc/cutlass/include" pack/src/csrc/cutlass/
tar cJf fa.tar.xz -C pack obj src && ls -la fa.tar.xz
