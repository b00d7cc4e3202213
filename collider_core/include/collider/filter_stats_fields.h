// Every field of collider::FilterStats (collider.h) by name, in declaration order: the one list
// the Python bindings (python/src/bindings.cpp: the attributes and collider.FilterStats.to_dict),
// the timing rows' "filter_stats" object (harness/measure/point_measurements.cpp) and the
// benchmarks read. A field added to FilterStats is added here once; the static_assert below
// counts them.
//   for_each_filter_stats_field([&](const char* name, auto FilterStats::*member) { ... });
#pragma once

#include <collider/collider.h>

namespace collider {

template <class F>
void for_each_filter_stats_field(F&& f) {
  f("nodes_visited", &FilterStats::nodes_visited);
  f("nodes_rewritten", &FilterStats::nodes_rewritten);
  f("tensors_gathered", &FilterStats::tensors_gathered);
  f("bytes_before", &FilterStats::bytes_before);
  f("bytes_gathered", &FilterStats::bytes_gathered);
  f("tensors_hooked", &FilterStats::tensors_hooked);
  f("gather_nodes_inserted", &FilterStats::gather_nodes_inserted);
  f("checked", &FilterStats::checked);
  f("gemms_packed", &FilterStats::gemms_packed);
  f("nodes_run_whole", &FilterStats::nodes_run_whole);
  f("batch", &FilterStats::batch);
  f("seq_len", &FilterStats::seq_len);
  f("kept", &FilterStats::kept);
  f("kept_total", &FilterStats::kept_total);
  f("kept_min", &FilterStats::kept_min);
  f("kept_max", &FilterStats::kept_max);
  f("rewrite_ms", &FilterStats::rewrite_ms);
  f("gather_ms", &FilterStats::gather_ms);
}

// 16 int64_t counts and 2 double times: a field added to the struct but not above fails here.
static_assert(sizeof(FilterStats) == 16 * sizeof(int64_t) + 2 * sizeof(double),
              "FilterStats changed: list its fields in for_each_filter_stats_field");

}  // namespace collider
