# Runs a GoogleTest binary on a filter and fails unless the run passed, ran
# exactly EXPECTED_TESTS tests, skipped none, and printed a line matching
# EXPECTED_OUTPUT: a filter that matches no test, or a run that took another
# path than the one it is there to check, cannot pass.
#
#   cmake -DBINARY=<test binary> -DFILTER=<gtest filter> -DEXPECTED_TESTS=<n>
#         -DEXPECTED_OUTPUT=<regex> -P run_gtest_expecting.cmake
foreach(var BINARY FILTER EXPECTED_TESTS EXPECTED_OUTPUT)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "run_gtest_expecting.cmake: -D${var}=... is required")
  endif()
endforeach()

execute_process(COMMAND "${BINARY}" "--gtest_filter=${FILTER}"
                RESULT_VARIABLE result OUTPUT_VARIABLE output ERROR_VARIABLE output)
message("${output}")
if(NOT result EQUAL 0)
  message(FATAL_ERROR "${BINARY} --gtest_filter=${FILTER} exited with ${result}")
endif()
string(REGEX MATCH "\\[  PASSED  \\] ([0-9]+) tests?\\." passed_line "${output}")
if(NOT passed_line OR NOT CMAKE_MATCH_1 EQUAL EXPECTED_TESTS)
  message(FATAL_ERROR "--gtest_filter=${FILTER} passed '${passed_line}', expected "
                      "${EXPECTED_TESTS} tests to run and pass")
endif()
if(output MATCHES "\\[  SKIPPED \\]")
  message(FATAL_ERROR "--gtest_filter=${FILTER} skipped a test")
endif()
if(NOT output MATCHES "${EXPECTED_OUTPUT}")
  message(FATAL_ERROR "the output has no line matching '${EXPECTED_OUTPUT}'")
endif()
