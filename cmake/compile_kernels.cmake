# Compiles loom's CUDA kernels into a fatbinary (`cmake -P`, run by the build's custom
# command), or copies the fatbinary that an identical compile left in CACHE_DIR.
#
# Why: every build of loom compiles the same kernels with nvcc, minutes on a small machine,
# and a checkout is often built more than once (the Python package with pip and the tests
# with CMake, as CI and scripts/test.sh do; a pip reinstall after a Python-only change). The
# key is everything the fatbinary depends on: nvcc's version, the host compiler, the flags
# and the contents of every source file (kernels.cu includes only files of src/cuda, all
# listed in SOURCES), so a hit stands for what a compile of the same inputs writes. The
# folder keeps the kKeep most recently used fatbinaries (15 MB each), older ones are removed.
#
# In: NVCC, FLAGS (a list, without -I and -o), INCLUDE_DIR, MAIN (kernels.cu), SOURCES (a
# list), SOURCE_ROOT (SOURCES are keyed by their path below it), HOST_COMPILER, OUTPUT,
# CACHE_DIR (empty: no cache).
cmake_minimum_required(VERSION 3.22)
set(kKeep 8)

execute_process(COMMAND ${NVCC} --version OUTPUT_VARIABLE nvcc_version RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "${NVCC} --version failed: is the CUDA toolkit installed whole?")
endif()
string(REPLACE ";" " " flags_line "${FLAGS}")
set(key "nvcc: ${nvcc_version}\nhost compiler: ${HOST_COMPILER}\nflags: ${flags_line}\n")
foreach(source IN LISTS SOURCES)
  file(SHA256 ${source} digest)
  file(RELATIVE_PATH name ${SOURCE_ROOT} ${source})
  string(APPEND key "${name} ${digest}\n")
endforeach()
string(SHA256 key_digest "${key}")
set(cached "${CACHE_DIR}/${key_digest}.fatbin")

if(CACHE_DIR AND EXISTS "${cached}")
  # A build beside this one may prune the entry between the check and the copy: then this
  # build compiles, as on a miss.
  file(COPY_FILE "${cached}" "${OUTPUT}" RESULT copied)
  if(copied STREQUAL "0")
    file(TOUCH_NOCREATE "${cached}")  # recently used: kept longest
    message(STATUS "loom's CUDA kernels: sources and flags unchanged, reused ${cached}")
    return()
  endif()
  message(STATUS "loom's CUDA kernels: ${cached} could not be copied (${copied}); compiling")
endif()

execute_process(COMMAND ${NVCC} ${FLAGS} -I${INCLUDE_DIR} -o ${OUTPUT} ${MAIN}
  RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "nvcc could not compile ${MAIN} (its messages are above)")
endif()

if(CACHE_DIR)
  # Written under a name of its own and renamed into place, so a build running beside this
  # one never copies half a file. A cache that cannot be written costs the reuse, no more.
  string(RANDOM LENGTH 12 tag)
  execute_process(COMMAND ${CMAKE_COMMAND} -E make_directory "${CACHE_DIR}"
    RESULT_VARIABLE mkdir_error OUTPUT_QUIET ERROR_QUIET)
  set(copy_error "${mkdir_error}")
  if(mkdir_error EQUAL 0)
    file(COPY_FILE "${OUTPUT}" "${cached}.${tag}.partial" RESULT copy_error)
  endif()
  if(copy_error STREQUAL "0")
    file(RENAME "${cached}.${tag}.partial" "${cached}" RESULT rename_error)
  endif()
  if(NOT copy_error STREQUAL "0" OR NOT rename_error STREQUAL "0")
    file(REMOVE "${cached}.${tag}.partial")
    message(WARNING "loom's CUDA kernels were compiled, but could not be kept in ${CACHE_DIR} "
      "for the next build (set LOOM_CUDA_KERNEL_CACHE to a writable folder, or to an empty "
      "value to keep none)")
    return()
  endif()
  # The least recently used beyond kKeep go (each edit of a kernel source adds one).
  file(GLOB entries "${CACHE_DIR}/*.fatbin")
  set(stamped "")
  foreach(entry IN LISTS entries)
    file(TIMESTAMP "${entry}" used "%s")
    list(APPEND stamped "${used}|${entry}")
  endforeach()
  list(SORT stamped COMPARE NATURAL ORDER DESCENDING)
  list(LENGTH stamped count)
  if(count GREATER kKeep)
    list(SUBLIST stamped ${kKeep} -1 stale)
    foreach(item IN LISTS stale)
      string(REGEX REPLACE "^[0-9]+\\|" "" path "${item}")
      file(REMOVE "${path}")
    endforeach()
  endif()
endif()
