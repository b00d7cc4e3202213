# `cmake --install build --prefix P` installs collider::core as a CMake package:
# another project does find_package(collider CONFIG) (with P and torch's cmake_prefix_path on
# CMAKE_PREFIX_PATH) and links collider::core.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)
install(TARGETS collider_core EXPORT colliderTargets
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
  INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(DIRECTORY ${PROJECT_SOURCE_DIR}/collider_core/include/collider
  DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(EXPORT colliderTargets NAMESPACE collider:: DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/collider)
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/colliderConfig.cmake.in
  ${PROJECT_BINARY_DIR}/colliderConfig.cmake INSTALL_DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/collider)
write_basic_package_version_file(${PROJECT_BINARY_DIR}/colliderConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/colliderConfig.cmake ${PROJECT_BINARY_DIR}/colliderConfigVersion.cmake
  ${PROJECT_SOURCE_DIR}/cmake/ColliderTorch.cmake
  DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/collider)
