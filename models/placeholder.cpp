// Placeholder so the library links while the models land (replaced by the architectures).
