#!/usr/bin/env bash
# Sets up a fresh Debian 12 machine (as root), builds memsim, then runs one of:
#   tools/dev.sh example [simulate options]   the default example (memsim simulate)
#   tools/dev.sh test                          every test (ctest)
#   tools/dev.sh build                         only the build
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(cmake g++ make ccache libtorch-dev nlohmann-json3-dev libyaml-cpp-dev
          libboost-program-options-dev libgtest-dev libbenchmark-dev python3 python3-matplotlib)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "dev.sh: installing ${missing[*]}" >&2
  apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
fi

cmake -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build build -j2 >&2

command=${1:-example}
shift || true
case "$command" in
  example) exec build/memsim simulate "$@" ;;
  test) cd build && exec ctest --output-on-failure -j2 "$@" ;;
  build) ;;
  *) echo "usage: tools/dev.sh example|test|build" >&2; exit 2 ;;
esac
