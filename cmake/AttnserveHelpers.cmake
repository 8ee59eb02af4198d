# Small helpers shared by every folder.

# Warnings every attnserve target is compiled with.
function(attnserve_warnings target)
  target_compile_options(${target} PRIVATE -Wall -Wextra)
  if(ATTNSERVE_WERROR)
    target_compile_options(${target} PRIVATE -Werror)
  endif()
endfunction()

# attnserve_link_allocator(<executable>): links ATTNSERVE_MALLOC's allocator
# (jemalloc, with its settings in cli/jemalloc_settings.cc) into a binary;
# nothing for "system" and for sanitizer builds (they bring their own).
function(attnserve_link_allocator target)
  if(ATTNSERVE_MALLOC STREQUAL "jemalloc" AND NOT ATTNSERVE_SANITIZE)
    find_package(PkgConfig REQUIRED)
    pkg_check_modules(JEMALLOC REQUIRED IMPORTED_TARGET jemalloc)
    target_sources(${target} PRIVATE ${PROJECT_SOURCE_DIR}/cli/jemalloc_settings.cc)
    target_link_libraries(${target} PRIVATE PkgConfig::JEMALLOC)
  elseif(NOT ATTNSERVE_MALLOC STREQUAL "system" AND NOT ATTNSERVE_SANITIZE)
    message(FATAL_ERROR "ATTNSERVE_MALLOC must be jemalloc or system, not '${ATTNSERVE_MALLOC}'")
  endif()
endfunction()

# attnserve_test(NAME <name> SOURCES <files...> LIBS <targets...> [LABELS <labels...>])
# One GoogleTest binary per test file, registered with CTest test by test.
# The sanitizer labels say which tests deploy/sanitize.sh builds and runs:
# `asan` (untrusted input, buffer arithmetic, lifetimes: target asan_tests,
# under ASan + UBSan) and `tsan` (our threads without gRPC: target
# tsan_tests, under ThreadSanitizer).
function(attnserve_test)
  cmake_parse_arguments(T "" "NAME" "SOURCES;LIBS;LABELS" ${ARGN})
  add_executable(${T_NAME} ${T_SOURCES})
  target_link_libraries(${T_NAME} PRIVATE ${T_LIBS} GTest::gtest GTest::gmock GTest::gtest_main)
  attnserve_warnings(${T_NAME})
  if(NOT T_LABELS)
    set(T_LABELS unit)
  endif()
  foreach(sanitizer asan tsan)
    if(sanitizer IN_LIST T_LABELS)
      attnserve_sanitizer_binary(${sanitizer} ${T_NAME})
    endif()
  endforeach()
  gtest_discover_tests(${T_NAME}
    DISCOVERY_TIMEOUT 60)
  # gtest_discover_tests passes a list-valued property on as separate words,
  # so the labels are set by a file CTest reads after the discovered list
  # (which defines <target>_TESTS).
  set(label_file ${CMAKE_CURRENT_BINARY_DIR}/${T_NAME}_labels.cmake)
  file(WRITE ${label_file}
    "if(${T_NAME}_TESTS)\n"
    "  set_tests_properties(\${${T_NAME}_TESTS} PROPERTIES LABELS \"${T_LABELS}\")\n"
    "endif()\n")
  set_property(DIRECTORY APPEND PROPERTY TEST_INCLUDE_FILES ${label_file})
endfunction()

# attnserve_sanitizer_binary(<asan|tsan> <target>): adds a test binary to the
# target <sanitizer>_tests and to the list <build>/<sanitizer>_tests.txt that
# deploy/sanitize.sh reads (written by attnserve_write_sanitizer_lists once
# every test is defined).
function(attnserve_sanitizer_binary sanitizer target)
  if(NOT TARGET ${sanitizer}_tests)
    add_custom_target(${sanitizer}_tests)
  endif()
  add_dependencies(${sanitizer}_tests ${target})
  set_property(GLOBAL APPEND PROPERTY ATTNSERVE_${sanitizer}_BINARIES "$<TARGET_FILE:${target}>")
endfunction()

function(attnserve_write_sanitizer_lists)
  foreach(sanitizer asan tsan)
    if(NOT TARGET ${sanitizer}_tests)
      add_custom_target(${sanitizer}_tests)
    endif()
    get_property(binaries GLOBAL PROPERTY ATTNSERVE_${sanitizer}_BINARIES)
    file(GENERATE OUTPUT ${CMAKE_BINARY_DIR}/${sanitizer}_tests.txt CONTENT "${binaries}")
  endforeach()
endfunction()
