// Durations as progress lines print them (duration.h).
#include "base/duration.h"

#include <cstdint>
#include <cstdio>

namespace collider {

std::string hms(double seconds) {
  const int64_t s = static_cast<int64_t>(seconds + 0.5);
  char buf[48];
  std::snprintf(buf, sizeof buf, "%lld:%02lld:%02lld", static_cast<long long>(s / 3600),
                static_cast<long long>((s / 60) % 60), static_cast<long long>(s % 60));
  return buf;
}

}  // namespace collider
