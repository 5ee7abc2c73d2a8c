# Finds the CUTLASS/CuTe headers, in this order:
#   1. -DCUTLASS_INCLUDE_DIR=<dir holding cute/ and cutlass/>
#   2. .deps/cutlass/include, where scripts/deps.sh installs them
#   3. the pip package nvidia-cutlass of the python3 on PATH (it ships the headers under
#      cutlass_library/source/include)
set(CUTLASS_INCLUDE_DIR "" CACHE PATH "Directory holding the cute/ and cutlass/ headers")
if(NOT CUTLASS_INCLUDE_DIR AND EXISTS "${PROJECT_SOURCE_DIR}/.deps/cutlass/include/cute/tensor.hpp")
  set(CUTLASS_INCLUDE_DIR "${PROJECT_SOURCE_DIR}/.deps/cutlass/include" CACHE PATH "" FORCE)
endif()
if(NOT CUTLASS_INCLUDE_DIR)
  find_package(Python3 COMPONENTS Interpreter QUIET)
  if(Python3_Interpreter_FOUND)
    execute_process(
      COMMAND "${Python3_EXECUTABLE}" -c
        "import cutlass_library, os; print(os.path.join(os.path.dirname(cutlass_library.__file__), 'source', 'include'))"
      OUTPUT_VARIABLE _cutlass_from_pip OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
    if(_cutlass_from_pip AND EXISTS "${_cutlass_from_pip}/cute/tensor.hpp")
      set(CUTLASS_INCLUDE_DIR "${_cutlass_from_pip}" CACHE PATH "" FORCE)
    endif()
  endif()
endif()
if(NOT CUTLASS_INCLUDE_DIR OR NOT EXISTS "${CUTLASS_INCLUDE_DIR}/cute/tensor.hpp")
  message(FATAL_ERROR "CUTLASS/CuTe headers not found. Run scripts/deps.sh, or pass -DCUTLASS_INCLUDE_DIR=<dir>, "
                      "or pip install nvidia-cutlass==4.2.0.0.")
endif()
message(STATUS "CUTLASS headers: ${CUTLASS_INCLUDE_DIR}")
add_library(megamoe_cutlass INTERFACE)
target_include_directories(megamoe_cutlass SYSTEM INTERFACE "${CUTLASS_INCLUDE_DIR}")
