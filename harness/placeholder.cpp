// Placeholder so the library links while the harness lands.
