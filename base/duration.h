// Durations as progress lines print them (h:mm:ss): the step loop of a training run, the sweep's
// per-point lines and the training recipe's totals. Tests: tests/test_stats.cpp.
#pragma once

#include <string>

namespace collider {

// seconds, rounded to the nearest second -> "h:mm:ss" (hours not wrapped: "26:03:07").
std::string hms(double seconds);

}  // namespace collider
