#!/usr/bin/env bash
# DeepGEMM (kernels/fp8/deepgemm.py's library) with its extension built against a given torch, packed
# as deep_gemm.tgz (untar it onto PYTHONPATH; scripts/device/fp8_gemm_libs.sh reads .dglib/deep_gemm.tgz).
# Why: the sgl-deep-gemm wheels on PyPI (0.2.1 .. 0.2.5) link c10::cuda::CUDAErrorLogCapture, which
# torch 2.11 lacks (torch >= 2.12 has it): on the device image's torch 2.11 their _C.so does not load.
#   scripts/build_deep_gemm.sh SRC CUTLASS_INCLUDE OUT_TGZ
# SRC: a DeepGEMM checkout (sgl-project/DeepGEMM main; 2026-12-06 built from a348cd9);
# CUTLASS_INCLUDE: a folder holding cute/ and cutlass/ (DeepGEMM's third-party/cutlass/include, or
# the sgl-deep-gemm wheel's deep_gemm/include): copied into the package, its JIT compiles with them.
# Build where the target torch is installed (default: python3's), or cross-build against a torch
# wheel unpacked elsewhere: TORCH_DIR (its torch/ folder), PY_INCLUDE (Python.h of the target
# Python), EXTRA_INCLUDE / EXTRA_LIB (cuBLAS / cuSPARSE / cuSOLVER / NVRTC headers and libnvrtc.so
# when the CUDA toolkit lacks them: the nvidia-* cu13 wheels' include/ and lib/). ~3 min on 2 cores.
set -euo pipefail
SRC=$1 CUTLASS=$2 OUT=$3
CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$(command -v nvcc)")")}
TORCH_DIR=${TORCH_DIR:-$(python3 -c "import os, torch; print(os.path.dirname(torch.__file__))")}
PY_INCLUDE=${PY_INCLUDE:-$(python3 -c "import sysconfig; print(sysconfig.get_paths()['include'])")}
EXT=${EXT_SUFFIX:-.cpython-312-x86_64-linux-gnu.so}
WORK=$(mktemp -d)
cp -r "$SRC/deep_gemm" "$WORK/"
cp -r "$CUTLASS/cute" "$CUTLASS/cutlass" "$WORK/deep_gemm/include/"
inc=(-I"$TORCH_DIR/include" -I"$TORCH_DIR/include/torch/csrc/api/include" -I"$PY_INCLUDE"
  -I"$CUDA_HOME/include" -I"$CUDA_HOME/include/cccl" -I"$WORK/deep_gemm/include")
[ -n "${EXTRA_INCLUDE:-}" ] && inc+=(-I"$EXTRA_INCLUDE")
lib=(-L"$TORCH_DIR/lib" -L"$CUDA_HOME/lib64")
[ -n "${EXTRA_LIB:-}" ] && lib+=(-L"$EXTRA_LIB")
# torch's own flags for an extension (torch.utils.cpp_extension), fmt from torch's headers
c++ -std=c++17 -O3 -fPIC -shared -Wno-psabi -Wno-deprecated-declarations -D_GLIBCXX_USE_CXX11_ABI=1 \
  -DTORCH_EXTENSION_NAME=_C -DTORCH_API_INCLUDE_EXTENSION_H "${inc[@]}" "$SRC/csrc/python_api.cpp" \
  -o "$WORK/deep_gemm/_C$EXT" "${lib[@]}" -lcudart -lnvrtc -lc10 -lc10_cuda -ltorch -ltorch_cpu \
  -ltorch_cuda -ltorch_python
find "$WORK" -name __pycache__ -prune -exec rm -rf {} +
tar czf "$OUT" -C "$WORK" deep_gemm
rm -rf "$WORK"
echo "wrote $OUT"
