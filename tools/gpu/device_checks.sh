#!/bin/bash
# The GPU session's checks in one run (tools/gpu/README.md), from the repository root on a
# machine with a CUDA GPU and PyTorch 2.x: the real caching allocator, cuBLAS workspaces
# and ATen ops measured (tools/gpu/measure.py), and memsim built against that PyTorch's
# LibTorch, then its validation suite and tests run there. Results go to $OUT (at most
# 8 files). Debian packages memsim needs that the machine lacks come as .deb files in
# $MEMSIM_DEBS (yaml-cpp, Boost program_options, nlohmann-json, GoogleTest), unpacked
# into a private prefix, never into /.
#
# Usage: OUT=DIR MEMSIM_DEBS=DIR [BUILD_SECONDS=330] [BUILD_TARGETS="memsim ..."]
#        [PARTS="allocator workspaces ops build megatron"]
#        [ALLOC_CONFS="default expandable_segments:True ..."]
#        [MEGATRON_DIR=DIR MEGATRON_CASES="case.yaml ..." MEGATRON_ITERATIONS=5]
#        tools/gpu/device_checks.sh
# ALLOC_CONFS: the allocator replays run once per PYTORCH_CUDA_ALLOC_CONF setting ("default":
# unset), each into its own file, allocator[_SETTING].json.
# megatron: Megatron-LM's own training of each case in MEGATRON_CASES (validation case files
# with --transformer-impl local), the measured rank alone on this GPU through Megatron's
# fake process group (tools/gpu/megatron_fake_pg.py); MEGATRON_DIR holds a Megatron-LM
# checkout's megatron/, pretrain_gpt.py, gpt_builders.py and model_provider.py. Results
# and allocator traces are packed into megatron_fake_pg.tgz.
set -u
OUT=${OUT:?set OUT to the results folder}
DEBS=${MEMSIM_DEBS:-.gpu_carry/debs}
BUILD_SECONDS=${BUILD_SECONDS:-330}
BUILD_TARGETS=${BUILD_TARGETS:-}
PARTS=" ${PARTS:-allocator workspaces ops build} "
ALLOC_CONFS=${ALLOC_CONFS:-default}
want() { [[ $PARTS == *" $1 "* ]]; }
BUILD=/tmp/memsim-build-torch2
DEPS=/tmp/memsim-deps
mkdir -p "$OUT"
exec > >(tee "$OUT/device.log") 2>&1
start=$SECONDS
stamp() { echo "== $(( SECONDS - start )) s: $*"; }

stamp environment
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "cxx11 abi", torch.compiled_with_cxx11_abi())'
g++ --version | head -1; cmake --version | head -1; command -v ninja dpkg ar || true
nproc

build_memsim() {
  mkdir -p "$DEPS"
  for deb in "$DEBS"/*.deb; do
    if command -v dpkg >/dev/null; then
      dpkg -x "$deb" "$DEPS"
    else
      member=$(ar t "$deb" | grep '^data\.tar')
      ar p "$deb" "$member" | tar -x --auto-compress -f - -C "$DEPS" 2>/dev/null ||
        ar p "$deb" "$member" | tar -xJ -C "$DEPS"
    fi
  done
  local torch_cmake lib=$DEPS/usr/lib/x86_64-linux-gnu generator=()
  torch_cmake=$(python3 -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')
  command -v ninja >/dev/null && generator=(-G Ninja)
  local flags=(-DCMAKE_BUILD_TYPE=RelWithDebInfo "${generator[@]}"
    "-DCMAKE_PREFIX_PATH=$torch_cmake;$DEPS/usr"
    "-DCMAKE_CXX_FLAGS=-isystem $DEPS/usr/include"
    "-DCMAKE_EXE_LINKER_FLAGS=-L$lib -Wl,-rpath,$lib"
    "-DCMAKE_SHARED_LINKER_FLAGS=-L$lib -Wl,-rpath,$lib")
  if ! cmake -S . -B "$BUILD" "${flags[@]}"; then
    # PyTorch's own CMake config wants the CUDA toolkit it was built with; memsim compiles
    # no CUDA code, so name LibTorch's headers and libraries directly.
    echo "== PyTorch's CMake config failed; retrying with LibTorch named directly"
    local root cfg=/tmp/memsim-torch-config
    root=$(python3 -c 'import os, torch; print(os.path.dirname(torch.__file__))')
    mkdir -p "$cfg"
    cat > "$cfg/TorchConfig.cmake" <<EOF
add_library(memsim_libtorch INTERFACE IMPORTED)
set_target_properties(memsim_libtorch PROPERTIES
  INTERFACE_INCLUDE_DIRECTORIES "$root/include;$root/include/torch/csrc/api/include"
  INTERFACE_COMPILE_DEFINITIONS "_GLIBCXX_USE_CXX11_ABI=1"
  INTERFACE_LINK_LIBRARIES "$root/lib/libtorch.so;$root/lib/libtorch_cpu.so;$root/lib/libtorch_cuda.so;$root/lib/libc10.so;$root/lib/libc10_cuda.so;-Wl,-rpath,$root/lib")
set(TORCH_LIBRARIES memsim_libtorch)
set(Torch_FOUND TRUE)
EOF
    rm -rf "$BUILD"
    cmake -S . -B "$BUILD" "${flags[@]}" "-DTorch_DIR=$cfg" || return 1
  fi
  # -k 0 / -k: every compile error in one run, not the first.
  if [ ${#generator[@]} -gt 0 ]; then
    timeout "$BUILD_SECONDS" ninja -C "$BUILD" -k 0 -j "$(( $(nproc) - 2 ))" $BUILD_TARGETS
  else
    timeout "$BUILD_SECONDS" make -C "$BUILD" -k -j "$(( $(nproc) - 2 ))" $BUILD_TARGETS
  fi
}

if want build; then
  stamp "building memsim against this PyTorch (background, at most $BUILD_SECONDS s)"
  ( build_memsim > "$OUT/build.log" 2>&1; echo "build exit $?" >> "$OUT/build.log" ) &
  build_pid=$!
fi
if want allocator; then
  for conf in $ALLOC_CONFS; do
    stamp "allocator replays, PYTORCH_CUDA_ALLOC_CONF=$conf"
    if [ "$conf" = default ]; then
      python3 tools/gpu/measure.py allocator "$OUT/allocator.json" simulator/testdata/allocator/*.events.gz
    else
      PYTORCH_CUDA_ALLOC_CONF=$conf python3 tools/gpu/measure.py allocator \
        "$OUT/allocator_${conf//[^A-Za-z0-9]/_}.json" simulator/testdata/allocator/*.events.gz
    fi
  done
fi
if want workspaces; then
  stamp workspaces
  python3 tools/gpu/measure.py workspaces "$OUT/workspaces.json"
fi
if want ops; then
  stamp ops
  python3 tools/gpu/measure.py ops "$OUT/ops.json"
fi
if want megatron; then
  : "${MEGATRON_DIR:?set MEGATRON_DIR to a Megatron-LM checkout (megatron/, pretrain_gpt.py ...)}"
  : "${MEGATRON_CASES:?set MEGATRON_CASES to the validation case files to run}"
  stamp "Megatron-LM's training on this GPU, fake process group"
  # Megatron compiles its dataset helpers on rank 0 only, and the fake run is another rank.
  ( cd "$MEGATRON_DIR/megatron/core/datasets" &&
    g++ -O3 -shared -std=c++17 -fPIC $(python3 -m pybind11 --includes) helpers.cpp -o \
      "helpers_cpp$(python3 -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')" ) ||
    echo "== Megatron's dataset helpers did not compile"
  PYTHONPATH=$PWD/tools/gpu/megatron_standins${PYTHONPATH:+:$PYTHONPATH} \
    python3 tools/gpu/megatron_fake_pg.py "$MEGATRON_DIR" /tmp/megatron_fake_pg $MEGATRON_CASES \
    --budget "${MEGATRON_SECONDS:-300}" --iterations "${MEGATRON_ITERATIONS:-5}"
  # Compressed: the memory traces are plain JSON, and a large file does not come back.
  tar -C /tmp/megatron_fake_pg -czf "$OUT/megatron_fake_pg.tgz" .
fi
want build || exit 0

stamp "waiting for the build"
wait $build_pid
tail -3 "$OUT/build.log"
grep -c "error:" "$OUT/build.log" || true
if [ -x "$BUILD/memsim" ]; then
  stamp "validation suite on the PyTorch 2 build"
  timeout 120 "$BUILD/memsim" validate --jobs "$(nproc)" --json "$OUT/validate.json" | tail -8
  stamp "default example"
  timeout 60 "$BUILD/memsim" simulate --json --out /tmp/memsim-example | head -c 3000
fi
if [ -x "$BUILD/memsim_tests" ]; then
  stamp tests
  (cd "$BUILD" && timeout 120 ctest -j "$(nproc)" --output-on-failure > "$OUT/tests.log" 2>&1)
  tail -25 "$OUT/tests.log"
fi
stamp done
