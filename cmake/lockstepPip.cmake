# What `pip install` (pyproject.toml, scikit-build-core) changes in the configuration: the libtorch
# is the one of the torch that the Python running pip imports (Python_EXECUTABLE, set by
# scikit-build-core), the package installs at the root of the wheel's site-packages, and the
# build takes the CPU half of a CUDA wheel's libtorch (the extension uses no CUDA; the nccl
# backend loads NCCL itself when asked), so the extension needs nothing of the toolkit at run time.
include_guard(GLOBAL)

# Forced: a build directory kept between installs (--config-settings=build-dir=...) may have
# served another environment's Python.
set(LOCKSTEP_PYTHON_EXECUTABLE "${Python_EXECUTABLE}" CACHE FILEPATH "The Python pip runs" FORCE)
set(LOCKSTEP_PYTHON_INSTALL_DIR "." CACHE STRING "Where lockstep_torch is installed, relative to the prefix")
set(LOCKSTEP_CUDA OFF CACHE STRING "A CUDA build of libtorch: its CPU half")

execute_process(
  COMMAND "${LOCKSTEP_PYTHON_EXECUTABLE}" -c "import os, torch; print(os.path.dirname(torch.__file__))"
  OUTPUT_VARIABLE _lockstep_torch_dir
  ERROR_VARIABLE _lockstep_torch_error
  RESULT_VARIABLE _lockstep_torch_result
  OUTPUT_STRIP_TRAILING_WHITESPACE)
if(NOT _lockstep_torch_result EQUAL 0)
  message(FATAL_ERROR
          "lockstep_torch is built for the torch of the Python that pip runs, and ${LOCKSTEP_PYTHON_EXECUTABLE} "
          "cannot import torch. Install torch into that environment first, then build without pip's build "
          "isolation (an isolated build sees no torch):\n"
          "  pip install scikit-build-core && pip install --no-build-isolation <lockstep checkout>\n"
          "${_lockstep_torch_error}")
endif()
# Debian's python3-torch keeps its CMake package under /usr (found as usual); a wheel's is inside it.
if(EXISTS "${_lockstep_torch_dir}/share/cmake/Torch")
  list(PREPEND CMAKE_PREFIX_PATH "${_lockstep_torch_dir}/share/cmake")
  list(PREPEND CMAKE_LIBRARY_PATH "${_lockstep_torch_dir}/lib")
endif()
message(STATUS "lockstep: pip build for ${LOCKSTEP_PYTHON_EXECUTABLE}, torch in ${_lockstep_torch_dir}")
