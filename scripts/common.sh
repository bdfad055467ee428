# Shared by scripts/demo and scripts/test: install what is missing, configure once, build.
# Idempotent: a second run installs nothing and rebuilds only what changed.
set -euo pipefail

LOCKSTEP_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

# Which libtorch the torch-facing layers build on: LOCKSTEP_TORCH=debian (the default: Debian 12's
# libtorch-dev, PyTorch 1.13, from apt) or pip (PyTorch 2.x from PyPI, pinned below, in a venv: a
# CUDA build of about 5 GB that runs on CPU). Each has its own build directory.
LOCKSTEP_TORCH="${LOCKSTEP_TORCH:-debian}"
case "$LOCKSTEP_TORCH" in
  debian) BUILD_DIR="${LOCKSTEP_BUILD_DIR:-$LOCKSTEP_ROOT/build}" ;;
  pip) BUILD_DIR="${LOCKSTEP_BUILD_DIR:-$LOCKSTEP_ROOT/build-torch2}" ;;
  *) echo "lockstep: LOCKSTEP_TORCH must be debian or pip (got '$LOCKSTEP_TORCH')" >&2; exit 2 ;;
esac
TORCH_PIP_VERSION="2.15.0"  # the newest release when pinned (2026-11-27); pinned so a build does not change under us
# Outside the tree, so that a fresh clone (CI's) reuses a venv this machine already holds.
TORCH_VENV="${LOCKSTEP_TORCH_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/lockstep/venv-torch-$TORCH_PIP_VERSION}"

# Debian packages the torch-free core, its tests and its benchmarks need.
LOCKSTEP_PACKAGES=(
  build-essential cmake ninja-build pkg-config git
  libssl-dev zlib1g-dev libcli11-dev nlohmann-json3-dev
  libgloo-dev libopenmpi-dev openmpi-bin
  libgtest-dev libgmock-dev libbenchmark-dev
  python3-torch dataset-fashion-mnist fortunes fortunes-min
  libtorch-dev libopenblas0-pthread libyaml-cpp-dev chromium iproute2
  python3-dev pybind11-dev slurm-wlm munge libsentencepiece-dev sentencepiece
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
# libsentencepiece-dev reads SentencePiece tokenizers (gpt prepare-data); sentencepiece's spm_train
# and spm_encode train and check one in the data layer's tests.

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

# pip install into TORCH_VENV, or an error that says what to do when PyPI cannot be reached.
venv_pip_install() {
  "$TORCH_VENV/bin/pip" install -q "$@" && return
  cat >&2 <<EOF
lockstep: pip could not install $* from PyPI (its messages above).
  CERTIFICATE_VERIFY_FAILED: this network intercepts TLS; install its CA certificate (copy it to
    /usr/local/share/ca-certificates/ and run update-ca-certificates) or set PIP_CERT to it.
  No connection: behind a proxy, set HTTPS_PROXY; offline, PIP_FIND_LINKS=DIR with the wheels.
  LOCKSTEP_TORCH=debian $0 uses Debian's PyTorch 1.13 and needs no PyPI.
EOF
  exit 1
}

# LOCKSTEP_TORCH=pip: the pinned torch wheel in TORCH_VENV (Debian's python3 and python3-venv).
install_pip_torch() {
  install_missing_packages python3-venv
  [ -x "$TORCH_VENV/bin/python" ] || { mkdir -p "$(dirname "$TORCH_VENV")" && /usr/bin/python3 -m venv "$TORCH_VENV"; }
  if [ "$("$TORCH_VENV/bin/python" -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null)" != "$TORCH_PIP_VERSION" ]; then
    echo "lockstep: installing torch $TORCH_PIP_VERSION from PyPI into $TORCH_VENV (about 5 GB)"
    venv_pip_install "torch==$TORCH_PIP_VERSION"
  fi
  # numpy (torch warns without it), expecttest (PyTorch's distributed suite imports it), the
  # Hugging Face libraries the backend is tested under (tests/python/test_hf.py), the build
  # backend `pip install` uses (tests/python/test_pip.py), and the SentencePiece package whose
  # tokens `gpt prepare-data` must equal (tests/python/test_tokenizers.py), each brought to its
  # pinned version (a venv holding other versions is corrected, not trusted).
  local off_pin
  off_pin="$(venv_off_pin numpy==2.4.6 expecttest==0.3.0 transformers==5.24.0 tokenizers==0.23.3 \
    accelerate==1.15.0 safetensors==0.8.0 scikit-build-core==1.1.2 sentencepiece==0.1.99)"
  # shellcheck disable=SC2086  # one pin per word
  [ -z "$off_pin" ] || venv_pip_install $off_pin
}

# The pins (name==version) that TORCH_VENV does not hold at exactly that version, one per line.
venv_off_pin() {
  "$TORCH_VENV/bin/python" - "$@" <<'PY'
import importlib.metadata as metadata, sys
for pin in sys.argv[1:]:
    name, version = pin.split("==")
    try:
        held = metadata.version(name)
    except metadata.PackageNotFoundError:
        held = None
    if held != version:
        print(pin)
PY
}

# The CMake arguments that pick the libtorch: the wheel's own cmake files and libraries first (Debian's
# libtorch.so is on the default path too), and the Python backend built for the venv's python.
torch_cmake_args() {
  [ "$LOCKSTEP_TORCH" = pip ] || { echo "-DLOCKSTEP_PYTHON=ON"; return; }
  local torch_dir
  torch_dir="$("$TORCH_VENV/bin/python" -c 'import os, torch; print(os.path.dirname(torch.__file__))' 2>/dev/null)"
  echo "-DCMAKE_PREFIX_PATH=$torch_dir/share/cmake -DCMAKE_LIBRARY_PATH=$torch_dir/lib -DLOCKSTEP_PYTHON=ON" \
    "-DLOCKSTEP_PYTHON_EXECUTABLE=$TORCH_VENV/bin/python"
}

# One line naming the libtorch of this build, for logs.
torch_description() {
  if [ "$LOCKSTEP_TORCH" = pip ]; then
    echo "PyTorch $("$TORCH_VENV/bin/python" -c 'import torch; print(torch.__version__)') from pip ($TORCH_VENV), in $BUILD_DIR"
  else
    echo "Debian's libtorch $(dpkg-query -W -f='${Version}' libtorch-dev), in $BUILD_DIR"
  fi
}

# LOCKSTEP_TESTS (all, core or torch: CMakeLists.txt) picks the tests a build makes and
# LOCKSTEP_BUILD_BENCHMARKS (ON or OFF) whether the torch-facing benchmark programs build; both are
# set when BUILD_DIR is first configured. Later runs keep a build's choice unless it lacks tests
# they ask for (a build made with every test serves any run).
configure_and_build() {
  [ "$LOCKSTEP_TORCH" = pip ] && install_pip_torch
  local tests="${LOCKSTEP_TESTS:-all}"
  if [ ! -f "$BUILD_DIR/CMakeCache.txt" ]; then
    # Optimised as RelWithDebInfo (-O2, the level the benchmarks were measured at) but without
    # debug information, which made each file that includes libtorch a third slower to compile.
    # shellcheck disable=SC2046  # the arguments are words without spaces
    cmake -S "$LOCKSTEP_ROOT" -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release \
      "-DCMAKE_CXX_FLAGS_RELEASE=-O2 -DNDEBUG" "-DCMAKE_C_FLAGS_RELEASE=-O2 -DNDEBUG" -DLOCKSTEP_WERROR=ON \
      "-DLOCKSTEP_TESTS=$tests" "-DLOCKSTEP_BUILD_BENCHMARKS=${LOCKSTEP_BUILD_BENCHMARKS:-ON}" $(torch_cmake_args)
  else
    local built
    built="$(sed -n 's/^LOCKSTEP_TESTS:STRING=//p' "$BUILD_DIR/CMakeCache.txt")"
    if [ -n "$built" ] && [ "$built" != all ] && [ "$built" != "$tests" ]; then
      cmake -S "$LOCKSTEP_ROOT" -B "$BUILD_DIR" "-DLOCKSTEP_TESTS=$tests" >/dev/null
    fi
  fi
  cmake --build "$BUILD_DIR" -j "$(nproc)"
}
