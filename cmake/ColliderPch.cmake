# The torch precompiled headers and the per-target defaults that use them, for the full build
# (cmake/ColliderDeps.cmake) and the standalone Python build (python/CMakeLists.txt, what
# `pip install ./python` compiles). A TU that includes torch/torch.h spends most of its time in
# those headers without one; with one it reads the parsed state from the .gch instead.
# Two headers, since GCC takes a .gch only where the optimisation level matches:
#   collider_pch        the build type's flags (Release: -O3): the libraries, the CLI, the benchmarks;
#   collider_pch_tests  -O1: the GoogleTest executables and their helpers (collider_test_defaults).
# Tests compile at -O1 because most of a test TU's time is the optimiser over torch's inline
# templates (-O3: 36 CPU-s for tests/test_sweep.cpp, -O1: 23 CPU-s); what they test (the
# libraries) is still the -O3 code users link. Performance is measured by the benchmarks and the
# harness, never by a test.
set(COLLIDER_TEST_OPT_LEVEL -O1 CACHE STRING "Optimisation level of the test executables (the libraries keep the build type's)")
set(_collider_pch_headers <torch/torch.h> <torch/csrc/autograd/generated/Functions.h>)
foreach(_pch collider_pch collider_pch_tests)
  add_library(${_pch} OBJECT ${CMAKE_CURRENT_LIST_DIR}/pch_stub.cpp)
  target_link_libraries(${_pch} PRIVATE torch)
  target_compile_definitions(${_pch} PRIVATE ${COLLIDER_FMT_DEFINITIONS})
  target_compile_options(${_pch} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-fPIC -Wall -Wextra -Wno-unused-parameter>)
  target_precompile_headers(${_pch} PRIVATE ${_collider_pch_headers})
  # clang writes the build time into the .pch, so every fresh build of it has a new hash and ccache
  # (which hashes the .pch into each key) misses on every object of a rebuilt tree (build-fuzz/,
  # build-asan/). Without the timestamp the .pch is the same bytes for the same inputs.
  if(CMAKE_CXX_COMPILER_ID MATCHES "Clang")
    target_compile_options(${_pch} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:SHELL:-Xclang -fno-pch-timestamp>)
  endif()
endforeach()
# After the build type's -O3 on the command line, so it is the one that counts.
target_compile_options(collider_pch_tests PRIVATE $<$<COMPILE_LANGUAGE:CXX>:${COLLIDER_TEST_OPT_LEVEL}>)
set_target_properties(collider_pch_tests PROPERTIES EXCLUDE_FROM_ALL ON)

# Unity builds of the libraries: COLLIDER_UNITY_BATCH of a library's files compiled as one. GCC
# spends about 10 CPU-s on every file that includes torch/torch.h before it reaches the file's own
# code, precompiled header or not: the template instantiations that torch's inline functions ask
# for, deferred to the end of each file ("lang. deferred" in -ftime-report; an empty file with the
# header takes 10 s). A batch pays that once: four files of collider_core took 110 CPU-s one by
# one and 22 CPU-s as one. Files with their own flags (OpenMP, the c10d defines) stay alone
# (SKIP_UNITY_BUILD_INCLUSION where they are declared). COLLIDER_UNITY_BUILD=OFF compiles file by file.
option(COLLIDER_UNITY_BUILD "Compile each library in batches of COLLIDER_UNITY_BATCH files" ON)
set(COLLIDER_UNITY_BATCH 8 CACHE STRING "Files per batch of a library's unity build")

# collider_target_defaults(target): warnings, fmt mode, the libraries' precompiled header, unity
# batches.
function(collider_target_defaults target)
  target_compile_definitions(${target} PRIVATE ${COLLIDER_FMT_DEFINITIONS})
  target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-fPIC -Wall -Wextra -Wno-unused-parameter>)
  target_precompile_headers(${target} REUSE_FROM collider_pch)
  set_target_properties(${target} PROPERTIES UNITY_BUILD ${COLLIDER_UNITY_BUILD}
                                             UNITY_BUILD_BATCH_SIZE ${COLLIDER_UNITY_BATCH})
endfunction()

# collider_test_defaults(target): the same for a test executable or test helper, at
# COLLIDER_TEST_OPT_LEVEL with the tests' precompiled header.
function(collider_test_defaults target)
  target_compile_definitions(${target} PRIVATE ${COLLIDER_FMT_DEFINITIONS})
  target_compile_options(${target} PRIVATE
    $<$<COMPILE_LANGUAGE:CXX>:-fPIC -Wall -Wextra -Wno-unused-parameter ${COLLIDER_TEST_OPT_LEVEL}>)
  target_precompile_headers(${target} REUSE_FROM collider_pch_tests)
endfunction()
