# Shared by scripts/demo and scripts/test: install what is missing, configure once, build.
# Idempotent: a second run installs nothing and rebuilds only what changed.
set -euo pipefail

LOCKSTEP_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD_DIR="${LOCKSTEP_BUILD_DIR:-$LOCKSTEP_ROOT/build}"

# Debian packages the torch-free core, its tests and its benchmarks need.
LOCKSTEP_PACKAGES=(
  build-essential cmake ninja-build pkg-config git
  libssl-dev zlib1g-dev libcli11-dev nlohmann-json3-dev
  libgloo-dev libopenmpi-dev openmpi-bin
  libgtest-dev libgmock-dev libbenchmark-dev
  python3-torch dataset-fashion-mnist fortunes fortunes-min
  libtorch-dev libopenblas0-pthread libyaml-cpp-dev chromium iproute2
  python3-dev pybind11-dev slurm-wlm munge
)
# python3-torch (Debian's PyTorch 1.13 for /usr/bin/python3) is the real client the launcher
# tests run unmodified, and the peer the benchmarks compare against. dataset-fashion-mnist is
# the real data the data layer's tests and the demo read; fortunes and fortunes-min (about 2.6 MB
# of English, in ~40 category files) the text the GPT example trains on. libtorch-dev is the C++ frontend the
# ddp and train layers build on; Debian's libtorch multiplies matrices through libblas.so.3,
# which is the slow reference BLAS until an OpenBLAS package (libopenblas0-pthread) takes over
# that alternative. libyaml-cpp-dev reads the Trainer's --config files; chromium (headless)
# renders `lockstep report` pages in the tests; iproute2 (ip, tc) makes the network namespaces
# the multi-machine tests run in. python3-dev and pybind11-dev build the torch.distributed
# backend (python/) for Debian's python3-torch. slurm-wlm and munge give the Slurm test a real
# slurmctld, slurmd, srun and sbatch to start jobs with across namespaces (nothing else uses them).

install_missing_packages() {
  local missing=()
  for p in "${LOCKSTEP_PACKAGES[@]}" "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  echo "lockstep: installing ${missing[*]}"
  local sudo=""
  if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null || { echo "lockstep: need root (or sudo) to install: ${missing[*]}" >&2; exit 1; }
    sudo="sudo"
  fi
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
}

configure_and_build() {
  if [ ! -f "$BUILD_DIR/CMakeCache.txt" ]; then
    cmake -S "$LOCKSTEP_ROOT" -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DLOCKSTEP_WERROR=ON -DLOCKSTEP_PYTHON=ON
  fi
  cmake --build "$BUILD_DIR" -j "$(nproc)"
}
