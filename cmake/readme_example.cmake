# The C block after the marker "<!-- readme-example -->" in README.md, written
# to a file so the example is compiled exactly as printed. Used by
# examples/CMakeLists.txt (a test) and by scripts/test_install.sh, which has no
# configured test tree:
#   cmake -DREADME=README.md -DOUT=readme_example.c -P cmake/readme_example.cmake
function(attn_readme_example readme out)
  file(READ "${readme}" text)
  string(FIND "${text}" "<!-- readme-example -->" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "${readme} lacks the <!-- readme-example --> marker")
  endif()
  string(SUBSTRING "${text}" ${at} -1 rest)
  string(FIND "${rest}" "```c\n" open)
  math(EXPR open "${open} + 5")
  string(SUBSTRING "${rest}" ${open} -1 rest)
  string(FIND "${rest}" "```" close)
  string(SUBSTRING "${rest}" 0 ${close} code)
  file(WRITE "${out}" "${code}")
endfunction()

if(CMAKE_SCRIPT_MODE_FILE STREQUAL CMAKE_CURRENT_LIST_FILE)
  attn_readme_example("${README}" "${OUT}")
endif()
