# What Collider needs of the torch it builds against, used right after find_package(Torch) by the
# main build, the Python package's standalone build and the installed package config
# (find_package(collider)):
#  - collider_check_torch_range: the releases this source tree supports (docs/COMPATIBILITY.md has
#    the test behind each); a libtorch outside the range stops at configure time with what to
#    install, not with a compiler error in the autograd headers.
#    collider_core/include/collider/torch_compat.h holds what differs inside the range.
#  - collider_set_cxx_standard: the C++ standard the torch headers need. torch 2.14.0's headers
#    require C++20 (#error otherwise) but its CMake config does not ask for it (2.15.0's adds
#    cxx_std_20 to the torch target); up to 2.13, C++17.
#  - collider_wheel_cuda_link_options: a CUDA torch wheel ships its own CUDA libraries
#    (nvidia/*/lib beside torch/: cudart, cuBLAS, NCCL, ...), which libtorch_cuda finds through its
#    own run path. Torch's CMake config puts the CUDA toolkit's lib directory on the link's run path,
#    where the linker looks first for libtorch_cuda's dependencies and would hand it the toolkit's
#    older copies: torch 2.15's (CUDA 13.2) needs NCCL symbols the CUDA 13.0 toolkit's NCCL lacks.
#    These options put the wheel's directories first, for the linker and at run time.
set(COLLIDER_TORCH_MIN 2.11.0)
set(COLLIDER_TORCH_BELOW 2.16.0)

function(collider_check_torch_range version)
  if(NOT version)
    message(FATAL_ERROR "collider: find_package(Torch) gave no version; put the cmake_prefix_path of a "
                        "torch ${COLLIDER_TORCH_MIN} to 2.15.x wheel on CMAKE_PREFIX_PATH")
  endif()
  if(version VERSION_LESS COLLIDER_TORCH_MIN OR NOT version VERSION_LESS COLLIDER_TORCH_BELOW)
    message(FATAL_ERROR "collider: torch ${version} is outside the supported range ${COLLIDER_TORCH_MIN} to "
                        "2.15.x (docs/COMPATIBILITY.md). Install a supported one, e.g. "
                        "`pip install torch==2.15.0`, and configure again with its "
                        "torch.utils.cmake_prefix_path on CMAKE_PREFIX_PATH")
  endif()
endfunction()

function(collider_wheel_cuda_link_options torch_prefix out_var)
  file(GLOB _dirs "${torch_prefix}/../nvidia/*/lib")
  set(_options)
  foreach(_dir ${_dirs})
    get_filename_component(_dir "${_dir}" REALPATH)
    list(APPEND _options "LINKER:-rpath-link,${_dir}" "LINKER:-rpath,${_dir}")
  endforeach()
  set(${out_var} "${_options}" PARENT_SCOPE)
endfunction()

macro(collider_set_cxx_standard version)
  if(NOT "${version}" VERSION_LESS 2.14)
    set(CMAKE_CXX_STANDARD 20)
    set(CMAKE_CUDA_STANDARD 20)
  endif()
endmacro()
