# tests/ring/extra.cmake — the ring's tests beyond one mpirun on one host:
# two hosts for real (two network namespaces over a veth, TCP only) and
# faults (a rank killed or hung mid-ring, mismatched shards). Included from
# tests/ring/CMakeLists.txt when attn_ring is built (ATTN_HAVE_RING).
# Tests that need root and `ip netns` exit 77 elsewhere: ctest says skipped.
add_executable(ring_driver ${CMAKE_CURRENT_LIST_DIR}/ring_driver.c)
target_link_libraries(ring_driver PRIVATE attn_ring_static)
if(ATTN_LIBM)
  target_link_libraries(ring_driver PRIVATE ${ATTN_LIBM})
endif()

# They test the transport and the faults, not memory: a sanitizer build
# (unoptimised kernels, minutes per case) leaves them to test_ring.
if(ATTN_SANITIZE)
  return()
endif()
set(ATTN_RING_FAULTS ${CMAKE_CURRENT_LIST_DIR}/faults.sh)
set(ATTN_RING_EXTRA_TESTS ring_netns)
add_test(NAME ring_netns COMMAND ${CMAKE_CURRENT_LIST_DIR}/netns.sh $<TARGET_FILE:ring_driver>)
foreach(case kill stop stop-between mismatch-seq mismatch-heads mismatch-E mismatch-causal)
  add_test(NAME ring_fault_${case} COMMAND ${ATTN_RING_FAULTS} $<TARGET_FILE:ring_driver> ${case})
  list(APPEND ATTN_RING_EXTRA_TESTS ring_fault_${case})
endforeach()
foreach(case kill stop stop-between mismatch-seq)
  add_test(NAME ring_fault_${case}_net
           COMMAND ${ATTN_RING_FAULTS} --net $<TARGET_FILE:ring_driver> ${case})
  list(APPEND ATTN_RING_EXTRA_TESTS ring_fault_${case}_net)
endforeach()
# Each ends well inside a minute; the timeout only bounds a hang.
set_tests_properties(${ATTN_RING_EXTRA_TESTS} PROPERTIES SKIP_RETURN_CODE 77 TIMEOUT 120
                     LABELS ring)
if(DEFINED ATTN_MPI_TEST_ENV) # tests/ring/CMakeLists.txt's: root allowed, one thread
  set_tests_properties(${ATTN_RING_EXTRA_TESTS} PROPERTIES ENVIRONMENT "${ATTN_MPI_TEST_ENV}")
endif()
