# Finds every dependency and reports each optional one in a single line; nothing is dropped
# silently. Torch comes from the PyPI wheel: scripts/bootstrap.sh passes its
# torch.utils.cmake_prefix_path in CMAKE_PREFIX_PATH.

# fmt: libtorch ships fmt headers (12.x) in its include path, ahead of any system fmt, so a
# system libfmt would be an ABI mismatch. We use those headers header-only.
set(COLLIDER_FMT_DEFINITIONS FMT_HEADER_ONLY=1)

if(COLLIDER_CUDA)
  enable_language(CUDA)
  if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
    set(CMAKE_CUDA_ARCHITECTURES 90)
  endif()
endif()

find_package(Torch REQUIRED)
message(STATUS "collider: Torch ${Torch_VERSION} at ${TORCH_INSTALL_PREFIX}")
include(ColliderTorch)
collider_check_torch_range("${Torch_VERSION}")
collider_set_cxx_standard("${Torch_VERSION}")
# Torch's CMake config adds its flags to CMAKE_CXX_FLAGS (ABI flag); keep them.
set(CMAKE_CXX_FLAGS "${CMAKE_CXX_FLAGS} ${TORCH_CXX_FLAGS}")

# The torch wheel's CUDA libraries first on every link and run path (cmake/ColliderTorch.cmake says why).
collider_wheel_cuda_link_options("${TORCH_INSTALL_PREFIX}" _collider_wheel_link)
if(_collider_wheel_link)
  add_link_options(${_collider_wheel_link})
  message(STATUS "collider: CUDA libraries of the torch wheel first on the link and run paths")
endif()

find_package(tomlplusplus REQUIRED)
find_package(nlohmann_json 3 REQUIRED)

if(COLLIDER_BUILD_TESTS)
  find_package(GTest REQUIRED)
endif()
if(COLLIDER_BUILD_BENCH)
  find_package(benchmark REQUIRED)
endif()

# Optional components, one report line each.
find_package(CUDAToolkit QUIET)
if(CUDAToolkit_FOUND)
  message(STATUS "collider: optional CUDA toolkit ${CUDAToolkit_VERSION}: found (${CUDAToolkit_BIN_DIR})")
else()
  message(STATUS "collider: optional CUDA toolkit: not found (CPU-only build)")
endif()
if(TARGET CUDA::nvtx3)
  set(COLLIDER_HAVE_NVTX ON)
  message(STATUS "collider: optional NVTX3 headers: found (CUDA::nvtx3)")
else()
  set(COLLIDER_HAVE_NVTX OFF)
  message(STATUS "collider: optional NVTX3 headers: not found (NVTX ranges compiled out; trace files still work)")
endif()
message(STATUS "collider: optional CUDA sources (COLLIDER_CUDA): ${COLLIDER_CUDA}")

# Data-parallel training (harness/components/distributed.h) on libtorch's own c10d: ProcessGroupGloo and
# TCPStore are compiled into the wheel's libtorch_cpu, but the wheel lacks the gloo headers that
# ProcessGroupGloo.hpp includes. Debian's libgloo-dev provides them (headers only: we never link
# Debian's libgloo, the gloo code that runs is libtorch's own copy). COLLIDER_DISTRIBUTED=AUTO
# builds it when the headers are found; NCCL (ProcessGroupNCCL, libtorch_cuda) only with COLLIDER_CUDA.
find_path(COLLIDER_GLOO_INCLUDE_DIR gloo/rendezvous/store.h)
# AUTO (default) follows the headers at every configure, so installing them and reconfiguring
# turns it on; ON insists (an error without them), OFF never builds it.
set(COLLIDER_DISTRIBUTED AUTO CACHE STRING
    "Data-parallel training on c10d: AUTO (on when the gloo headers are found), ON or OFF")
set_property(CACHE COLLIDER_DISTRIBUTED PROPERTY STRINGS AUTO ON OFF)
if(COLLIDER_DISTRIBUTED STREQUAL "AUTO")
  if(COLLIDER_GLOO_INCLUDE_DIR)
    set(COLLIDER_HAVE_DISTRIBUTED ON)
  else()
    set(COLLIDER_HAVE_DISTRIBUTED OFF)
  endif()
elseif(COLLIDER_DISTRIBUTED)
  set(COLLIDER_HAVE_DISTRIBUTED ON)
else()
  set(COLLIDER_HAVE_DISTRIBUTED OFF)
endif()
if(COLLIDER_HAVE_DISTRIBUTED AND NOT COLLIDER_GLOO_INCLUDE_DIR)
  message(FATAL_ERROR "collider: COLLIDER_DISTRIBUTED=ON needs the gloo headers (gloo/rendezvous/store.h), which "
                      "libtorch's ProcessGroupGloo.hpp includes; install them with `apt-get install libgloo-dev` "
                      "(or ./scripts/bootstrap.sh), or configure with -DCOLLIDER_DISTRIBUTED=OFF")
endif()
set(COLLIDER_HAVE_NCCL OFF)
if(COLLIDER_HAVE_DISTRIBUTED)
  message(STATUS "collider: optional data-parallel training (COLLIDER_DISTRIBUTED=${COLLIDER_DISTRIBUTED}): ON, c10d Gloo with gloo headers "
                 "from ${COLLIDER_GLOO_INCLUDE_DIR}")
  if(COLLIDER_CUDA)
    # ProcessGroupNCCL.hpp includes nccl.h: the wheel's nvidia-nccl package, else the CUDA toolkit.
    find_path(COLLIDER_NCCL_INCLUDE_DIR nccl.h
      HINTS ${TORCH_INSTALL_PREFIX}/../nvidia/nccl/include ${CUDAToolkit_INCLUDE_DIRS})
    if(COLLIDER_NCCL_INCLUDE_DIR)
      set(COLLIDER_HAVE_NCCL ON)
      message(STATUS "collider: optional NCCL process group: ON (nccl.h in ${COLLIDER_NCCL_INCLUDE_DIR})")
    else()
      message(STATUS "collider: optional NCCL process group: not found (no nccl.h); CUDA runs use Gloo")
    endif()
  endif()
elseif(NOT COLLIDER_DISTRIBUTED STREQUAL "AUTO")
  message(STATUS "collider: optional data-parallel training: OFF (COLLIDER_DISTRIBUTED=${COLLIDER_DISTRIBUTED})")
else()
  message(STATUS "collider: optional data-parallel training (COLLIDER_DISTRIBUTED=${COLLIDER_DISTRIBUTED}): OFF "
                 "(gloo headers: ${COLLIDER_GLOO_INCLUDE_DIR}; `apt-get install libgloo-dev` and reconfigure to enable "
                 "`collider run` with RANK/WORLD_SIZE)")
endif()

# SentencePiece (Debian libsentencepiece-dev): the tokenizer of the utility runs (harness/components/token_data.h).
find_path(SENTENCEPIECE_INCLUDE_DIR sentencepiece_processor.h)
find_library(SENTENCEPIECE_LIBRARY sentencepiece)
if(SENTENCEPIECE_INCLUDE_DIR AND SENTENCEPIECE_LIBRARY)
  set(COLLIDER_HAVE_SENTENCEPIECE ON)
  message(STATUS "collider: optional SentencePiece: found (${SENTENCEPIECE_LIBRARY})")
else()
  set(COLLIDER_HAVE_SENTENCEPIECE OFF)
  message(STATUS "collider: optional SentencePiece: not found (harness::Tokenizer throws; install libsentencepiece-dev)")
endif()
if(CMAKE_CXX_COMPILER_LAUNCHER)
  message(STATUS "collider: optional ccache: ${CMAKE_CXX_COMPILER_LAUNCHER}")
else()
  message(STATUS "collider: optional ccache: not used")
endif()

# The torch precompiled headers and collider_target_defaults / collider_test_defaults.
include(ColliderPch)
