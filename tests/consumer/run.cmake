# cmake -P run.cmake -DBUILD_DIR=... -DWORK_DIR=... -DGENERATOR=... -DEXAMPLE=...: installs the
# build into a scratch prefix, then configures, builds and runs the consumer project against it.
foreach(step IN ITEMS install configure build run)
  if(step STREQUAL "install")
    set(command ${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${WORK_DIR}/prefix)
  elseif(step STREQUAL "configure")
    set(command ${CMAKE_COMMAND} -S ${CMAKE_CURRENT_LIST_DIR} -B ${WORK_DIR}/build -G ${GENERATOR}
                -DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix -DMEGAMOE_EXAMPLE_SOURCE=${EXAMPLE})
  elseif(step STREQUAL "build")
    set(command ${CMAKE_COMMAND} --build ${WORK_DIR}/build)
  else()
    set(command ${WORK_DIR}/build/host_consumer)
  endif()
  execute_process(COMMAND ${command} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "consumer ${step} failed (${rc}):\n${out}\n${err}")
  endif()
endforeach()
message("${out}")
