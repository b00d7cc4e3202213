// A point's failure in its row: the status ("oom" for every way an allocation fails, else
// "error") and the message of the exception that ended it. A DistributedError (a peer died or
// hung) is not a point's failure: it passes through and ends the run.
#pragma once

#include <nlohmann/json.hpp>

#include <exception>

namespace collider::harness {

// Sets row["status"] and row["error"] from `e`; rethrows a DistributedError.
void record_failure(nlohmann::json& row, const std::exception_ptr& e);

}  // namespace collider::harness
