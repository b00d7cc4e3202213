# The torch releases this source tree supports (docs/COMPATIBILITY.md has the test behind each),
# checked right after find_package(Torch) by the main build, the Python package's standalone build
# and the installed package config (find_package(collider)): a libtorch outside the range stops at
# configure time with what to install, not with a compiler error in the autograd headers.
# collider_core/include/collider/torch_compat.h holds what differs inside the range.
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
