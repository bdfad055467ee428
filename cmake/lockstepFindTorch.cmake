# lockstep_find_torch(): libtorch, as find_package(Torch CONFIG) finds it, with one exception.
#
# PyPI's torch wheel is a CUDA build, and its CMake package stops with "Your installed Caffe2
# version uses CUDA but I cannot find the CUDA libraries" on a machine without the CUDA toolkit
# (nvcc), which most CPU machines are. What a CPU build of lockstep uses of that libtorch is its
# CPU half, libtorch_cpu and libc10 (the CUDA half loads only with libtorch.so, as in Python), so
# there this defines the target `torch` over those two, with the variables TorchConfig.cmake sets
# (Torch_FOUND, Torch_DIR, Torch_VERSION, TORCH_INSTALL_PREFIX, TORCH_INCLUDE_DIRS,
# TORCH_LIBRARIES, TORCH_CXX_FLAGS) and the compile definitions its libtorch_cpu declares.
# LOCKSTEP_CUDA chooses: AUTO (the default) uses a CUDA libtorch whole when nvcc is here and its
# CPU half otherwise, OFF always its CPU half, ON always whole (its package then demands nvcc).
# LOCKSTEP_TORCH_CPU_ONLY says which happened.
include_guard(GLOBAL)
set(LOCKSTEP_CUDA AUTO CACHE STRING "A CUDA build of libtorch: AUTO (whole when nvcc is here), ON, or OFF (its CPU half)")
set_property(CACHE LOCKSTEP_CUDA PROPERTY STRINGS AUTO ON OFF)

# The directory of the TorchConfig.cmake find_package would use first, searched the way the pip
# build passes it (CMAKE_PREFIX_PATH = the wheel's share/cmake), or "" when none is there.
function(_lockstep_torch_config_dir out)
  find_file(_lockstep_torch_config TorchConfig.cmake HINTS ${CMAKE_PREFIX_PATH} ${Torch_DIR}
            PATH_SUFFIXES Torch NO_DEFAULT_PATH NO_CACHE)
  if(_lockstep_torch_config)
    get_filename_component(dir "${_lockstep_torch_config}" DIRECTORY)
    set(${out} "${dir}" PARENT_SCOPE)
  else()
    set(${out} "" PARENT_SCOPE)
  endif()
endfunction()

# True when the package in `config_dir` is a CUDA build to be used for its CPU half: LOCKSTEP_CUDA
# is OFF, or AUTO and this machine has no nvcc.
function(_lockstep_cpu_half_of_cuda_build config_dir out)
  set(${out} FALSE PARENT_SCOPE)
  set(caffe2 "${config_dir}/../Caffe2/Caffe2Config.cmake")
  if(NOT EXISTS "${caffe2}")
    return()
  endif()
  file(READ "${caffe2}" text)
  string(FIND "${text}" "set(CAFFE2_USE_CUDA 1)" uses_cuda)
  if(uses_cuda EQUAL -1)
    return()
  endif()
  if(LOCKSTEP_CUDA STREQUAL "OFF")
    set(${out} TRUE PARENT_SCOPE)
  elseif(LOCKSTEP_CUDA STREQUAL "AUTO")
    find_program(LOCKSTEP_NVCC nvcc HINTS ENV CUDA_HOME ENV CUDA_PATH /usr/local/cuda PATH_SUFFIXES bin)
    if(NOT LOCKSTEP_NVCC)
      set(${out} TRUE PARENT_SCOPE)
    endif()
  endif()
endfunction()

# The CPU half of the libtorch whose package is in `config_dir`, as the target `torch`.
macro(_lockstep_torch_cpu_half config_dir)
  get_filename_component(TORCH_INSTALL_PREFIX "${config_dir}/../../.." ABSOLUTE)
  set(Torch_DIR "${config_dir}")
  file(READ "${config_dir}/TorchConfigVersion.cmake" _lockstep_text)
  string(REGEX MATCH "set\\(PACKAGE_VERSION \"([^\"]+)\"\\)" _ "${_lockstep_text}")
  set(Torch_VERSION "${CMAKE_MATCH_1}")
  file(READ "${config_dir}/TorchConfig.cmake" _lockstep_text)
  string(REGEX MATCH "set\\(TORCH_CXX_FLAGS \"([^\"]*)\"\\)" _ "${_lockstep_text}")
  set(TORCH_CXX_FLAGS "${CMAKE_MATCH_1}")
  file(READ "${config_dir}/../Caffe2/Caffe2Targets.cmake" _lockstep_text)
  string(REGEX MATCH "add_library\\(torch_cpu SHARED IMPORTED\\)[^)]*INTERFACE_COMPILE_DEFINITIONS \"([^\"]*)\""
         _ "${_lockstep_text}")
  set(_lockstep_definitions "${CMAKE_MATCH_1}")
  find_library(LOCKSTEP_TORCH_CPU_LIBRARY torch_cpu PATHS "${TORCH_INSTALL_PREFIX}/lib" NO_DEFAULT_PATH REQUIRED)
  find_library(LOCKSTEP_C10_LIBRARY c10 PATHS "${TORCH_INSTALL_PREFIX}/lib" NO_DEFAULT_PATH REQUIRED)
  set(TORCH_INCLUDE_DIRS "${TORCH_INSTALL_PREFIX}/include" "${TORCH_INSTALL_PREFIX}/include/torch/csrc/api/include")
  if(NOT TARGET torch)
    # The names and properties of the package's own targets, so that code asking for them
    # (torch_cpu's location, say) finds them as it would.
    foreach(_lockstep_lib c10 torch_cpu)
      add_library(${_lockstep_lib} SHARED IMPORTED)
      set_target_properties(${_lockstep_lib} PROPERTIES IMPORTED_CONFIGURATIONS RELEASE
                            INTERFACE_INCLUDE_DIRECTORIES "${TORCH_INSTALL_PREFIX}/include")
    endforeach()
    set_target_properties(c10 PROPERTIES IMPORTED_LOCATION_RELEASE "${LOCKSTEP_C10_LIBRARY}")
    set_target_properties(torch_cpu PROPERTIES IMPORTED_LOCATION_RELEASE "${LOCKSTEP_TORCH_CPU_LIBRARY}"
                          INTERFACE_COMPILE_DEFINITIONS "${_lockstep_definitions}" INTERFACE_LINK_LIBRARIES c10)
    add_library(torch INTERFACE IMPORTED)
    set_target_properties(torch PROPERTIES
      INTERFACE_INCLUDE_DIRECTORIES "${TORCH_INCLUDE_DIRS}"
      INTERFACE_COMPILE_OPTIONS "${TORCH_CXX_FLAGS}"
      # Linked even where nothing names its symbols: loading it registers the operators.
      INTERFACE_LINK_LIBRARIES "-Wl,--no-as-needed;torch_cpu;-Wl,--as-needed")
    target_compile_features(torch INTERFACE cxx_std_20)
  endif()
  set(TORCH_LIBRARIES torch)
  set(Torch_FOUND TRUE)
endmacro()

macro(lockstep_find_torch)
  _lockstep_torch_config_dir(_lockstep_torch_dir)
  set(LOCKSTEP_TORCH_CPU_ONLY FALSE)
  if(_lockstep_torch_dir)
    _lockstep_cpu_half_of_cuda_build("${_lockstep_torch_dir}" LOCKSTEP_TORCH_CPU_ONLY)
  endif()
  set(_lockstep_why "")
  if(LOCKSTEP_CUDA STREQUAL "AUTO")
    set(_lockstep_why " and this machine has no CUDA toolkit (nvcc)")
  endif()
  if(LOCKSTEP_TORCH_CPU_ONLY)
    _lockstep_torch_cpu_half("${_lockstep_torch_dir}")
    message(STATUS "lockstep: libtorch ${Torch_VERSION} is a CUDA build; using its CPU half (libtorch_cpu, "
                   "libc10): LOCKSTEP_CUDA=${LOCKSTEP_CUDA}${_lockstep_why}")
  else()
    find_package(Torch CONFIG)
  endif()
endmacro()
