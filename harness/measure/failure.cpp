// record_failure (failure.h): a point's status and message from the exception that ended it.
#include "harness/measure/failure.h"

#include "harness/components/distributed.h"

#include <c10/util/Exception.h>

#include <new>
#include <stdexcept>
#include <string>

namespace collider::harness {
namespace {

bool looks_like_oom(const std::string& msg) {
  return msg.find("out of memory") != std::string::npos || msg.find("not enough memory") != std::string::npos ||
         msg.find("can't allocate memory") != std::string::npos;
}

}  // namespace

void record_failure(nlohmann::json& row, const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const DistributedError&) {
    throw;  // a peer died or hung: the run ends (cli.cpp prints it), no row
  } catch (const c10::OutOfMemoryError& e) {
    row["status"] = "oom";
    row["error"] = e.what_without_backtrace();
  } catch (const std::bad_alloc& e) {
    row["status"] = "oom";
    row["error"] = std::string("std::bad_alloc: ") + e.what();
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    row["status"] = looks_like_oom(msg) ? "oom" : "error";
    row["error"] = msg;
  } catch (const std::exception& e) {
    const std::string msg = e.what();
    row["status"] = looks_like_oom(msg) ? "oom" : "error";
    row["error"] = msg;
  }
}

}  // namespace collider::harness
