// write_group_figures and group_table (table.h): a group's figures written into its rows, and the
// rows as a console table.
#include "harness/measure/table.h"

#include "measuring/figures.h"

#include <fmt/format.h>

#include <cmath>

namespace collider::harness {
namespace {

double number(const nlohmann::json& row, const char* key) {
  const auto it = row.find(key);
  return it != row.end() && it->is_number() ? it->get<double>() : std::nan("");
}

bool ok(const nlohmann::json& row) { return row.value("status", "") == "ok"; }
bool is_floor(const nlohmann::json& row) { return row.contains("floor_of") && !row["floor_of"].is_null(); }

std::string label(const nlohmann::json& row) {
  const bool ragged = row.value("point_id", "").find("/batch_topk") != std::string::npos;
  return point_label(row.value("method", "?"), row.value("attention_grad", "none"), ragged, number(row, "filter_ratio"),
                     row.value("aa_copy", false), is_floor(row) ? row["seq_len"].get<int64_t>() : 0);
}

std::string cell(double v, const char* format) { return std::isnan(v) ? "-" : fmt::format(fmt::runtime(format), v); }

}  // namespace

std::string point_label(const std::string& method, const std::string& attention_grad, bool ragged, double filter_ratio,
                        bool aa_copy, int64_t floor_seq_len) {
  if (floor_seq_len > 0) return fmt::format("floor (regular at T'={})", floor_seq_len);
  std::string s = method;
  if (attention_grad != "none") s += " " + attention_grad;
  if (ragged) s += " batch_topk";
  if (method != "regular") s += fmt::format("@{:g}", filter_ratio);
  if (aa_copy) s += " (A/A)";
  return s;
}

namespace {

// What a filtering row (collider, forward_drop) is held to: its T' floor (collider's kept count per
// row, ragged rows: their mean rounded, the floor of the same total; forward_drop's middle count).
int64_t t_prime_of(const nlohmann::json& row) {
  int64_t t = row.value("method", "") == "forward_drop" && row["middle_tokens_per_seq"].is_number_integer()
                  ? row["middle_tokens_per_seq"].get<int64_t>()
                  : row.value("kept_per_seq", int64_t{-1});
  if (t < 0 && !std::isnan(number(row, "kept_per_row_mean"))) t = std::llround(number(row, "kept_per_row_mean"));
  return t;
}

bool filters(const nlohmann::json& row) {
  const std::string method = row.value("method", "");
  return method == "collider" || method == "forward_drop";
}

nlohmann::json value_or_null(double v) { return std::isnan(v) ? nlohmann::json(nullptr) : nlohmann::json(v); }

}  // namespace

void write_group_figures(std::vector<nlohmann::json>& rows) {
  using Role = stats::GroupRow::Role;
  std::vector<stats::GroupRow> in;
  std::vector<nlohmann::json*> measured;
  for (auto& row : rows) {
    if (!ok(row)) continue;
    stats::GroupRow r;
    const bool regular = row.value("method", "") == "regular";
    if (is_floor(row))
      r.role = Role::kFloor;
    else if (regular)
      r.role = row.value("aa_copy", false) ? Role::kCopy : Role::kBaseline;
    const double rewrite = number(row, "rewrite_ms");
    r.cost_ms = number(row, "bwd_ms") + (std::isnan(rewrite) ? 0.0 : rewrite);
    r.step_ms = number(row, "step_ms");
    if (filters(row)) {
      r.flop_ideal = number(row, "flop_ideal_bwd_reduction");
      r.t_prime = t_prime_of(row);
    }
    if (r.role == Role::kFloor) r.t_prime = row["seq_len"].get<int64_t>();
    in.push_back(r);
    measured.push_back(&row);
  }
  const std::vector<stats::GroupFigures> out = stats::group_figures(in);
  for (size_t i = 0; i < out.size(); ++i) {
    nlohmann::json& row = *measured[i];
    row["reduction"] = value_or_null(out[i].reduction);
    row["step_reduction"] = value_or_null(out[i].step_reduction);
    row["of_ideal"] = value_or_null(out[i].of_ideal);
    row["vs_floor"] = value_or_null(out[i].vs_floor);
  }
}

std::string group_table(const std::vector<nlohmann::json>& rows) {
  double regular_ms = std::nan("");
  for (const auto& row : rows) {
    if (ok(row) && row.value("method", "") == "regular" && !is_floor(row) && !row.value("aa_copy", false) &&
        std::isnan(regular_ms))
      regular_ms = number(row, "bwd_ms");
  }
  std::string out = fmt::format("  {:<34} {:>9} {:>6} {:>10} {:>8} {:>8} {:>10} {:>7} {:>9} {:>9} {:>9}\n", "method",
                                "bwd_ms", "+-IQR", "rewrite_ms", "rewrite%", "rw/reg%", "reduction", "ideal",
                                "of ideal", "vs floor", "peak_MiB");
  std::string cuts;  // below the table: run.copy_probe's lines
  for (const auto& row : rows) {
    if (!ok(row)) {
      out += fmt::format("  {:<34} {}: {}\n", label(row), row.value("status", "?"),
                         row["error"].is_string() ? row["error"].get<std::string>().substr(0, 80) : "");
      continue;
    }
    const double bwd = number(row, "bwd_ms"), rewrite = number(row, "rewrite_ms");
    const double ideal = filters(row) ? number(row, "flop_ideal_bwd_reduction") : std::nan("");
    // The rewrite against this point's backward (rewrite%) and regular's (rw/reg%); the reduction,
    // the share of the ideal and the ratio to the floor as write_group_figures wrote them.
    const double rw = std::isnan(rewrite) ? 0.0 : rewrite;
    out += fmt::format(
        "  {:<34} {:>9.2f} {:>5.1f}% {:>10.2f} {:>7.2f}% {:>7.2f}% {:>9.1f}% {:>7} {:>9} {:>9} {:>9.1f}\n", label(row),
        bwd, 100 * number(row, "bwd_ms_rel_iqr"), rw, 100 * rw / bwd, 100 * rw / regular_ms,
        100 * number(row, "reduction"), cell(100 * ideal, "{:.1f}%"), cell(number(row, "of_ideal"), "{:.3f}"),
        cell(number(row, "vs_floor"), "{:.2f}x"), number(row, "peak_mem_bytes") / 1048576.0);
    // run.copy_probe: the rewrite's cut bytes against a plain cold copy of them.
    if (row.contains("copy_floor_ms") && row.contains("filter_stats")) {
      const auto& fs = row["filter_stats"];
      const double copy = number(row, "copy_floor_ms");
      cuts += fmt::format(
          "  {:<34} {} saved tensors cut in the backward, {:.1f} MB; a plain cold copy of those bytes "
          "{:.2f} ms = {:.2f}% of the backward\n",
          label(row), fs.value("tensors_gathered", int64_t{0}),
          static_cast<double>(fs.value("bytes_gathered", int64_t{0})) / 1e6, copy, 100 * copy / bwd);
    }
  }
  out += cuts;
  return out;
}

}  // namespace collider::harness
