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
  list(GET T_LABELS 0 first_label)
  gtest_discover_tests(${T_NAME}
    PROPERTIES LABELS "${first_label}"
    DISCOVERY_TIMEOUT 60)
  # gtest_discover_tests flattens a list-valued property ("unit;tsan" would
  # become LABELS unit and a property named tsan): set several labels on the
  # discovered tests (${T_NAME}_TESTS) from a script CTest runs after them.
  list(LENGTH T_LABELS label_count)
  if(label_count GREATER 1)
    set(labels_file "${CMAKE_CURRENT_BINARY_DIR}/${T_NAME}_labels.cmake")
    file(WRITE "${labels_file}"
      "foreach(t IN LISTS ${T_NAME}_TESTS)\n"
      "  set_tests_properties(\"\${t}\" PROPERTIES LABELS \"${T_LABELS}\")\n"
      "endforeach()\n")
    set_property(DIRECTORY APPEND PROPERTY TEST_INCLUDE_FILES "${labels_file}")
  endif()
endfunction()
