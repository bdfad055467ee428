# Run by `cmake --install` of a pip build (python/CMakeLists.txt): writes
# lockstep_torch/runtime-libraries.txt, one "SONAME PACKAGE" line for each shared library the
# extension and the launcher load from the system (torch's own and the C library's left out), the
# package being the Debian package that holds it on the building machine. lockstep_torch_runtime.py
# reads it to name the command that installs what another machine lacks.
# In: LOCKSTEP_EXTENSION, LOCKSTEP_LAUNCHER (built files), LOCKSTEP_PACKAGE_DIR (installed package).
file(GET_RUNTIME_DEPENDENCIES
  LIBRARIES "${LOCKSTEP_EXTENSION}"
  EXECUTABLES "${LOCKSTEP_LAUNCHER}"
  RESOLVED_DEPENDENCIES_VAR resolved
  UNRESOLVED_DEPENDENCIES_VAR unresolved
  PRE_EXCLUDE_REGEXES "^libtorch" "^libc10" "^libshm" "^libgomp" "^libcu" "^libnv" "^ld-linux" "^libc\\.so"
                      "^libm\\.so" "^libdl\\.so" "^librt\\.so" "^libpthread\\.so" "^libstdc\\+\\+" "^libgcc_s"
  POST_EXCLUDE_REGEXES "/torch/lib/" "/nvidia/")
set(lines "")
foreach(library IN LISTS resolved)
  get_filename_component(soname "${library}" NAME)
  get_filename_component(real "${library}" REALPATH)
  # dpkg knows each file by the path its package ships: /usr/lib/... or, before Debian's merged
  # /usr, /lib/...; one of the names below is it.
  string(REGEX REPLACE "^/usr/" "/" real_unmerged "${real}")
  set(package "-")
  foreach(candidate IN ITEMS "${real}" "${real_unmerged}" "${library}")
    execute_process(COMMAND dpkg-query -S "${candidate}" OUTPUT_VARIABLE owner ERROR_QUIET RESULT_VARIABLE status)
    if(status EQUAL 0 AND owner MATCHES "^([^:, ]+)")
      set(package "${CMAKE_MATCH_1}")
      break()
    endif()
  endforeach()
  string(APPEND lines "${soname} ${package}\n")
endforeach()
file(WRITE "${LOCKSTEP_PACKAGE_DIR}/runtime-libraries.txt" "${lines}")
message(STATUS "lockstep_torch: loads at run time: ${resolved}")
