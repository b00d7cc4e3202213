// collider: the command-line entry point (DESIGN.md section 5). Subcommands live in
// harness/recipes/cli.cpp (models, run) and harness/recipes/score.cpp (score). Run `build/collider --help`.
#include "harness/recipes/cli.h"

#include <signal.h>

#include <string>
#include <vector>

int main(int argc, char** argv) {
  // Past a file size limit (ulimit -f) write(2) then fails with EFBIG, which the writers report
  // with the file's name, instead of the default SIGXFSZ killing the run with a core dump.
  ::signal(SIGXFSZ, SIG_IGN);
  // A data-parallel peer that died closes its sockets; a write to one must fail with EPIPE (the
  // collective then reports which rank failed, exit status 3), not kill this rank with SIGPIPE.
  ::signal(SIGPIPE, SIG_IGN);
  std::vector<std::string> args(argv + 1, argv + argc);
  return collider::harness::cli_main(args);
}
