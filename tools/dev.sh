#!/usr/bin/env bash
# Sets up a fresh Debian 12 machine (as root), builds memsim, then runs one of:
#   tools/dev.sh example [simulate options]   the default example (memsim simulate)
#   tools/dev.sh test                          every test (ctest)
#   tools/dev.sh build                         only the build
#   tools/dev.sh sanitize                      every test again, built with ASan and UBSan
#   tools/dev.sh fuzz [SECONDS]                each fuzz target for SECONDS (default 600)
# One GoogleTest test: build/memsim_tests --gtest_filter='Suite.Name' (ctest runs the suites
# as shards, MEMSIM_TEST_SHARDS in CMakeLists.txt).
set -euo pipefail
cd "$(dirname "$0")/.."

command=${1:-example}
shift || true

packages=(cmake g++ clang libclang-rt-14-dev make ccache libtorch-dev nlohmann-json3-dev libyaml-cpp-dev
          libboost-program-options-dev libgtest-dev libbenchmark-dev python3 python3-matplotlib)
if [ "$command" = test ]; then
  # The tests open memsim's snapshots with PyTorch 1.13's memory_viz and load `memsim view`
  # pages in Chromium.
  packages+=(python3-torch chromium)
fi
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "dev.sh: installing ${missing[*]}" >&2
  apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
fi

if [ "$command" = sanitize ] || [ "$command" = fuzz ]; then
  # clang, Debug (assertions on) at -O1, address and undefined-behaviour sanitizers and
  # libFuzzer's coverage; LibTorch itself is not instrumented, so its containers carry no
  # annotations for ASan to check. Line tables only (reports still name file and line):
  # full debug information made each file compile 13% slower.
  cmake -S . -B build-sanitize -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_BUILD_TYPE=Debug \
        -DMEMSIM_SANITIZE=ON -DCMAKE_CXX_FLAGS_DEBUG="-O1 -gline-tables-only" >/dev/null
  cmake --build build-sanitize -j2 >&2
  cd build-sanitize
  export ASAN_OPTIONS=detect_container_overflow=0:detect_leaks=0
  export UBSAN_OPTIONS=print_stacktrace=1
  if [ "$command" = fuzz ]; then
    export MEMSIM_FUZZ_SECONDS=${1:-600}
    exec ctest --output-on-failure -j2 -R '^fuzz_' --timeout $((MEMSIM_FUZZ_SECONDS + 120))
  fi
  # Each fuzz target runs 10 s here (a smoke test from the seeds; tools/dev.sh fuzz runs
  # them longer), which keeps CI well under 30 minutes.
  export MEMSIM_FUZZ_SECONDS=${MEMSIM_FUZZ_SECONDS:-10}
  # The seeds' 24-layout sweep (killed and resumed) takes 7.5 min under the sanitizers,
  # running every --help and README example (2 min plain) would take far longer, and the
  # sharded sweep merged and resumed takes 100 s; smaller tests cover the same code there
  # (the Robustness tests resume and merge sweeps), and the plain run runs all three. The Python
  # tools' tests run Python, not the sanitized C++ (2 min here): the plain run covers them.
  # The GoogleTest suites run as shards of memsim_tests (MEMSIM_TEST_SHARDS in CMakeLists.txt).
  export GTEST_FILTER='-Sweep.SeedsSweepKilledAndResumedMatchesAndPlots:Sweep.ResumedShardsEqualOneRun:Examples.EveryHelpAndReadmeExampleRuns'
  exec ctest --output-on-failure -j2 -E '^python_tools[.]' "$@"
fi

cmake -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build build -j2 >&2

case "$command" in
  example) exec build/memsim simulate "$@" ;;
  test) cd build && exec ctest --output-on-failure -j2 "$@" ;;
  build) ;;
  *) echo "usage: tools/dev.sh example|test|build|sanitize|fuzz [SECONDS]" >&2; exit 2 ;;
esac
