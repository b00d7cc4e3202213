// group_figures (figures.h): each row's reduction, share of the FLOP ideal and ratio to the T'
// floor, against the references found among the group's rows.
#include "measuring/figures.h"

#include <map>

namespace collider::stats {

std::vector<GroupFigures> group_figures(const std::vector<GroupRow>& rows) {
  const GroupRow* baseline = nullptr;
  std::map<int64_t, const GroupRow*> floors;  // by t_prime
  for (const auto& r : rows) {
    if (r.role == GroupRow::Role::kBaseline && !baseline) baseline = &r;
    if (r.role == GroupRow::Role::kFloor) floors.emplace(r.t_prime, &r);
  }
  std::vector<GroupFigures> out(rows.size());
  for (size_t i = 0; i < rows.size(); ++i) {
    const GroupRow& r = rows[i];
    GroupFigures& f = out[i];
    if (baseline) {
      f.reduction = &r == baseline ? 0.0 : 1.0 - r.cost_ms / baseline->cost_ms;
      f.step_reduction = &r == baseline ? 0.0 : 1.0 - r.step_ms / baseline->step_ms;
    }
    if (std::isfinite(r.flop_ideal) && r.flop_ideal > 0.0) f.of_ideal = f.reduction / r.flop_ideal;
    if (r.role != GroupRow::Role::kFloor && r.role != GroupRow::Role::kCopy && r.t_prime >= 0) {
      const auto it = floors.find(r.t_prime);
      if (it != floors.end()) f.vs_floor = r.cost_ms / it->second->cost_ms;
    }
  }
  return out;
}

}  // namespace collider::stats
