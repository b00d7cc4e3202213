// collider: command-line entry point (placeholder until the harness lands).
#include <cstdio>
int main() { std::puts("collider: harness not built yet"); return 1; }
