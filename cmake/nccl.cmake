# Finds NCCL for the expert-parallel baseline: -DNCCL_ROOT=<dir with include/ and lib/>, the CUDA
# toolkit's own copy, or the pip package nvidia-nccl-cu13 of the python3 on PATH (what PyTorch
# ships; the GPU machines have it). Defines megamoe_nccl when found.
set(NCCL_ROOT "" CACHE PATH "NCCL install prefix (include/nccl.h, lib/libnccl.so)")
set(_nccl_hints "${NCCL_ROOT}" "${CUDAToolkit_LIBRARY_ROOT}")
find_package(Python3 COMPONENTS Interpreter QUIET)
if(Python3_Interpreter_FOUND)
  execute_process(
    COMMAND "${Python3_EXECUTABLE}" -c "import nvidia.nccl, os; print(os.path.dirname(nvidia.nccl.__file__))"
    OUTPUT_VARIABLE _nccl_from_pip OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  list(APPEND _nccl_hints "${_nccl_from_pip}")
endif()
find_path(NCCL_INCLUDE_DIR nccl.h HINTS ${_nccl_hints} ${CUDAToolkit_INCLUDE_DIRS} PATH_SUFFIXES include)
find_library(NCCL_LIBRARY NAMES nccl libnccl.so.2 HINTS ${_nccl_hints} ${CUDAToolkit_LIBRARY_DIR} PATH_SUFFIXES lib lib64)
if(NCCL_INCLUDE_DIR AND NCCL_LIBRARY)
  message(STATUS "NCCL: ${NCCL_LIBRARY}")
  add_library(megamoe_nccl INTERFACE)
  target_include_directories(megamoe_nccl INTERFACE "${NCCL_INCLUDE_DIR}")
  target_link_libraries(megamoe_nccl INTERFACE "${NCCL_LIBRARY}")
else()
  message(STATUS "NCCL not found: megamoe-ep-bench (expert-parallel bench with the NCCL baseline) is not built")
endif()
