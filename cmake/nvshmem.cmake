# Finds NVSHMEM for comm::SymmetricBackend::nvshmem: -DNVSHMEM_ROOT=<dir with include/nvshmem.h
# and lib/libnvshmem_host.so.3>, or the pip package nvidia-nvshmem-cu13 of the python3 CMake finds
# (a dependency of PyTorch's CUDA 13 wheels; the GPU machines have it). The build takes NVSHMEM's
# headers only: the host library is opened when the backend is first used (dlopen: the library
# found here, else the loader's search for libnvshmem_host.so.3), so that nothing megamoe builds
# depends on NVSHMEM being installed where it runs.
# MEGAMOE_NVSHMEM: AUTO builds the backend where found, ON fails the configure step without it,
# OFF leaves it out (the backend then refuses with ErrorCode::unsupported). Defines
# megamoe_nvshmem (an interface target) when the backend is built.
set(MEGAMOE_NVSHMEM AUTO CACHE STRING "Build the NVSHMEM symmetric-memory backend: AUTO, ON or OFF")
set_property(CACHE MEGAMOE_NVSHMEM PROPERTY STRINGS AUTO ON OFF)
set(NVSHMEM_ROOT "" CACHE PATH "NVSHMEM install prefix (include/nvshmem.h, lib/libnvshmem_host.so.3)")
string(TOUPPER "${MEGAMOE_NVSHMEM}" _nvshmem_mode)
if(NOT _nvshmem_mode MATCHES "^(AUTO|ON|OFF)$")
  message(FATAL_ERROR "MEGAMOE_NVSHMEM is '${MEGAMOE_NVSHMEM}'; it takes AUTO, ON or OFF")
endif()
if(NOT _nvshmem_mode STREQUAL "OFF")
  set(_nvshmem_hints "${NVSHMEM_ROOT}")
  find_package(Python3 COMPONENTS Interpreter QUIET)
  if(Python3_Interpreter_FOUND)
    # nvidia.nvshmem is a namespace package: its folder is the first entry of __path__.
    execute_process(
      COMMAND "${Python3_EXECUTABLE}" -c "import nvidia.nvshmem as m; print(list(m.__path__)[0])"
      OUTPUT_VARIABLE _nvshmem_from_pip OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
    list(APPEND _nvshmem_hints "${_nvshmem_from_pip}")
  endif()
  find_path(NVSHMEM_INCLUDE_DIR nvshmem.h HINTS ${_nvshmem_hints} PATH_SUFFIXES include NO_DEFAULT_PATH)
  # The wheel ships only the versioned name (no libnvshmem_host.so link).
  find_library(NVSHMEM_HOST_LIBRARY NAMES nvshmem_host libnvshmem_host.so.3 HINTS ${_nvshmem_hints}
               PATH_SUFFIXES lib lib64 NO_DEFAULT_PATH)
  if(NVSHMEM_INCLUDE_DIR AND NVSHMEM_HOST_LIBRARY)
    message(STATUS "NVSHMEM: ${NVSHMEM_INCLUDE_DIR} (symmetric-memory backend built; opens ${NVSHMEM_HOST_LIBRARY})")
    add_library(megamoe_nvshmem INTERFACE)
    target_include_directories(megamoe_nvshmem SYSTEM INTERFACE "${NVSHMEM_INCLUDE_DIR}")
    # (The library finds its bootstrap and transport plugins beside itself: its run path is $ORIGIN.)
    target_link_libraries(megamoe_nvshmem INTERFACE ${CMAKE_DL_LIBS})
    target_compile_definitions(megamoe_nvshmem INTERFACE MEGAMOE_HAVE_NVSHMEM=1
                                                         MEGAMOE_NVSHMEM_HOST_LIBRARY="${NVSHMEM_HOST_LIBRARY}")
  elseif(_nvshmem_mode STREQUAL "ON")
    message(FATAL_ERROR "MEGAMOE_NVSHMEM=ON but NVSHMEM was not found: pass -DNVSHMEM_ROOT=<prefix> or "
                        "install nvidia-nvshmem-cu13 into the python3 CMake uses (${Python3_EXECUTABLE})")
  else()
    message(STATUS "NVSHMEM not found: the nvshmem symmetric-memory backend is not built (MEGAMOE_NVSHMEM=AUTO)")
  endif()
endif()
