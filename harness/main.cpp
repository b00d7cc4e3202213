// collider: the command-line entry point (DESIGN.md section 5). Subcommands live in
// harness/cli.cpp (models, run) and harness/score.cpp (score). Run `build/collider --help`.
#include "harness/cli.h"

#include <string>
#include <vector>

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  return collider::harness::cli_main(args);
}
