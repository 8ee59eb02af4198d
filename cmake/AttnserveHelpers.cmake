# Small helpers shared by every folder.

# Warnings every attnserve target is compiled with.
function(attnserve_warnings target)
  target_compile_options(${target} PRIVATE -Wall -Wextra)
  if(ATTNSERVE_WERROR)
    target_compile_options(${target} PRIVATE -Werror)
  endif()
endfunction()

# attnserve_test(NAME <name> SOURCES <files...> LIBS <targets...> [LABELS <labels...>])
# One GoogleTest binary per test file, registered with CTest test by test.
function(attnserve_test)
  cmake_parse_arguments(T "" "NAME" "SOURCES;LIBS;LABELS" ${ARGN})
  add_executable(${T_NAME} ${T_SOURCES})
  target_link_libraries(${T_NAME} PRIVATE ${T_LIBS} GTest::gtest GTest::gmock GTest::gtest_main)
  attnserve_warnings(${T_NAME})
  if(NOT T_LABELS)
    set(T_LABELS unit)
  endif()
  gtest_discover_tests(${T_NAME}
    PROPERTIES LABELS "${T_LABELS}"
    DISCOVERY_TIMEOUT 60)
endfunction()
