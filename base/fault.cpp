// Fault injection points (fault.h).
#include "base/fault.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <thread>
#include <cstdlib>
#include <cstring>
#include <string>

namespace collider::fault {
namespace {

struct Target {
  std::string point;  // empty: no fault armed
  long nth = 1;
};

const Target& target() {
  static const Target t = [] {
    Target r;
    const char* env = std::getenv("COLLIDER_FAULT_AT");
    if (env == nullptr || *env == '\0') return r;
    std::string s = env;
    const auto colon = s.find(':');
    r.point = s.substr(0, colon);
    if (colon != std::string::npos) r.nth = std::max(1L, std::strtol(s.c_str() + colon + 1, nullptr, 10));
    return r;
  }();
  return t;
}

std::atomic<long> g_hits{0};
thread_local const char* g_scope = nullptr;

}  // namespace

bool armed(const char* point) { return !target().point.empty() && target().point == point; }

void hit(const char* point) {
  const Target& t = target();
  if (t.point.empty() || t.point != point) return;
  if (g_hits.fetch_add(1) + 1 == t.nth) ::kill(::getpid(), SIGKILL);
}

void hold(const char* point) {
  static const std::string env = [] {
    const char* e = std::getenv("COLLIDER_FAULT_HOLD");
    return std::string(e ? e : "");
  }();
  const auto colon = env.find(':');
  if (colon == std::string::npos || env.compare(0, colon, point) != 0) return;
  const std::string file = env.substr(colon + 1);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(300);
  while (::access(file.c_str(), F_OK) != 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

Scope::Scope(const char* point) : previous_(g_scope) { g_scope = point; }
Scope::~Scope() { g_scope = previous_; }
const char* current_scope() { return g_scope; }

}  // namespace collider::fault
