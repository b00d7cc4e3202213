// Stub translation unit that carries the shared precompiled header (cmake/ColliderDeps.cmake).
