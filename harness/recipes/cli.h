// The `collider` command line (DESIGN.md section 5):
//   collider models [--json]
//   collider run MANIFEST.toml [--set key=value]... [--out DIR] [--dry-run] [--resume]
//                              [--trace FILE] [--profile-steps a:b]
//   collider score ...          (harness/recipes/score.h)
// Exit codes: 0 success; 1 a point failed or a run-time error; 2 a usage or manifest error
// (nothing computed, no rows written); 3 a data-parallel run failed (a rank died or hung, the
// rendezvous failed, or a point failed on some rank).
// Tests: tests/test_sweep.cpp (run), tests/test_manifest.cpp (errors via the CLI entry).
#pragma once

#include <iosfwd>
#include <string>
#include <vector>

namespace collider::harness {

int cli_main(const std::vector<std::string>& args);  // args without the program name
int run_models_command(const std::vector<std::string>& args, std::ostream& out);
// collider figures: each group's figures (harness/measure/table.h) written into existing results files.
int run_figures_command(const std::vector<std::string>& paths, std::ostream& out);
int run_run_command(const std::vector<std::string>& args, std::ostream& out, std::ostream& err);
std::string usage();
}  // namespace collider::harness
