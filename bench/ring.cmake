# bench/ring.cmake — the ring's benchmark program (bench/ring_run.py runs it
# under mpirun; `make bench-ring`). Included from bench/CMakeLists.txt when
# attn_ring is built (ATTN_HAVE_RING).
add_executable(ring_bench ${CMAKE_CURRENT_LIST_DIR}/ring_bench.c)
target_link_libraries(ring_bench PRIVATE attn_ring_static)
