// Plan: construction, copying, merging and its text form. The text form is line based, one block
// per traced variant:
//   collider-plan 1 trace B=3,5 T=53,61 cores=<n>
//   node <i> <Type> <0 | 1 attention core | 2 fused attention | 3 fused cross-attention | 4 run whole> [<edges>]
//        edges: the plan indices of
//        its next edges, comma separated, -1 for an edge to no node; "-" for none (optional on reading)
//   field <name> <kind> <item> <rank> <pad_rank> <bcast_dim> <bcast_mult> <dims>   dims: dim:kind:role:mult[:route],... (route: routed kinds only)
//   insert <node> <edge> <rank> <pad_rank> <bcast_dim> <bcast_mult> <dims>
//   blocker <text to end of line>
#include <collider/collider.h>

#include "node_traits.h"
#include "plan_impl.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cstdlib>
#include <sstream>

namespace collider {

Plan::Plan() : impl_(std::make_unique<Impl>()) {}
Plan::~Plan() = default;
Plan::Plan(const Plan& o) : impl_(std::make_unique<Impl>(*o.impl_)) {}
Plan& Plan::operator=(const Plan& o) {
  if (this != &o) impl_ = std::make_unique<Impl>(*o.impl_);
  return *this;
}
Plan::Plan(Plan&&) noexcept = default;
Plan& Plan::operator=(Plan&&) noexcept = default;

namespace {
// The first variant for batches of B > 1 (the one the counts describe); an empty one for an empty plan.
const detail::PlanData& first_batched(const Plan::Impl& impl) {
  static const detail::PlanData empty;
  for (const auto& v : impl.variants)
    if (v.batch_a > 1) return v;
  return empty;
}
}  // namespace

int64_t Plan::num_nodes() const { return static_cast<int64_t>(first_batched(*impl_).nodes.size()); }

int64_t Plan::num_token_nodes() const {
  int64_t n = 0;
  for (const auto& ns : first_batched(*impl_).nodes) n += ns.fields.empty() ? 0 : 1;
  return n;
}

int64_t Plan::num_variants() const { return static_cast<int64_t>(impl_->variants.size()); }

std::string Plan::summary() const {
  const auto& d = first_batched(*impl_);
  std::string variants = impl_->variants.size() > 2 ? fmt::format(", {} traced variants", impl_->variants.size()) : "";
  return fmt::format("{} nodes, {} with token dimensions, {} attention cores, exact_query {}{}", num_nodes(),
                     num_token_nodes(), d.num_attention_cores,
                     d.exact_query_blocker.empty() ? "available" : "unavailable (" + d.exact_query_blocker + ")",
                     variants);
}

namespace {

std::string shape_text(const detail::ShapeSpec& s) {
  std::string dims;
  for (const auto& d : s.dims) {
    if (!dims.empty()) dims += ",";
    dims += fmt::format("{}:{}:{}:{}", d.dim, static_cast<int>(d.kind), static_cast<int>(d.role), d.mult);
    if (d.has_route()) dims += fmt::format(":{}", d.route);
  }
  return fmt::format("{} {} {} {} {}", s.rank, s.pad_rank, s.bcast_batch_dim, s.bcast_mult, dims.empty() ? "-" : dims);
}

detail::ShapeSpec parse_shape(std::istringstream& in, int line_no) {
  detail::ShapeSpec s;
  std::string dims;
  if (!(in >> s.rank >> s.pad_rank >> s.bcast_batch_dim >> s.bcast_mult >> dims)) {
    throw Error(fmt::format("Plan::from_string: line {}: malformed shape", line_no));
  }
  if (dims == "-") return s;
  std::istringstream ds(dims);
  std::string item;
  while (std::getline(ds, item, ',')) {
    detail::DimSpec d;
    int kind = 0, role = 0;
    const int got = std::sscanf(item.c_str(), "%d:%d:%d:%ld:%d", &d.dim, &kind, &role, &d.mult, &d.route);
    if (kind < 0 || kind > static_cast<int>(detail::DimKind::kFlatPerToken)) {
      throw Error(fmt::format("Plan::from_string: line {}: malformed dimension '{}'", line_no, item));
    }
    d.kind = static_cast<detail::DimKind>(kind);
    const bool routed = d.has_route();
    if (got != (routed ? 5 : 4) || role < 0 || role > 1 || (routed && d.route < 0)) {
      throw Error(fmt::format("Plan::from_string: line {}: malformed dimension '{}'", line_no, item));
    }
    d.role = static_cast<detail::Role>(role);
    s.dims.push_back(d);
  }
  return s;
}

}  // namespace

namespace {
std::string variant_text(const detail::PlanData& d) {
  std::string out = fmt::format("collider-plan 1 trace B={},{} T={},{} cores={}\n", d.batch_a, d.batch_b, d.seq_a,
                                d.seq_b, d.num_attention_cores);
  for (size_t i = 0; i < d.nodes.size(); ++i) {
    const auto& n = d.nodes[i];
    std::string edges = "-";
    if (i < d.children.size() && !d.children[i].empty()) edges = fmt::format("{}", fmt::join(d.children[i], ","));
    out += fmt::format("node {} {} {}{}\n", i, n.type,
                       n.run_whole        ? 4
                       : n.fused_attention  ? (n.cross_attention ? 3 : 2)
                       : n.attention_core ? 1
                                          : 0,
                       d.children.size() == d.nodes.size() ? " " + edges : "");
    for (const auto& f : n.fields) {
      out += fmt::format("field {} {} {} {}\n", f.name, static_cast<int>(f.kind), f.item, shape_text(f.shape));
    }
  }
  for (const auto& ins : d.inserts) out += fmt::format("insert {} {} {}\n", ins.node, ins.edge, shape_text(ins.shape));
  for (const auto& e : d.detached) out += fmt::format("detach {} {}\n", e.node, e.edge);
  if (!d.exact_query_blocker.empty()) out += "blocker " + d.exact_query_blocker + "\n";
  return out;
}
}  // namespace

// Every variant in order (trace_plan's two: batches of B > 1, then B = 1; then merged ones).
std::string Plan::to_string() const {
  std::string out;
  for (const auto& v : impl_->variants) out += variant_text(v);
  return out;
}

void Plan::merge(const Plan& other) {
  for (const auto& v : other.impl_->variants) {
    const std::string text = variant_text(v);
    bool known = false;
    for (const auto& mine : impl_->variants) known = known || variant_text(mine) == text;
    if (!known) impl_->variants.push_back(v);
  }
}

Plan Plan::from_string(const std::string& text) {
  Plan plan;
  detail::PlanData* dp = nullptr;
  int variants = 0;
  std::istringstream lines(text);
  std::string line;
  int line_no = 0;
  while (std::getline(lines, line)) {
    ++line_no;
    if (line.empty()) continue;
    std::istringstream in(line);
    std::string tag;
    in >> tag;
    if (tag == "collider-plan") {
      ++variants;
      dp = &plan.impl().variants.emplace_back();
      auto& d = *dp;
      int version = 0;
      std::string trace, bs, ts, cores;
      if (!(in >> version >> trace >> bs >> ts >> cores) || version != 1 ||
          std::sscanf(bs.c_str(), "B=%ld,%ld", &d.batch_a, &d.batch_b) != 2 ||
          std::sscanf(ts.c_str(), "T=%ld,%ld", &d.seq_a, &d.seq_b) != 2 ||
          std::sscanf(cores.c_str(), "cores=%ld", &d.num_attention_cores) != 1) {
        throw Error("Plan::from_string: not a collider plan (expected a 'collider-plan 1 ...' header line)");
      }
      continue;
    }
    if (!dp) throw Error("Plan::from_string: not a collider plan (expected a 'collider-plan 1 ...' header line)");
    auto& d = *dp;
    if (tag == "node") {
      size_t idx = 0;
      detail::NodeSpec n;
      int core = 0;
      if (!(in >> idx >> n.type >> core) || idx != d.nodes.size() || core < 0 || core > 4) {
        throw Error(fmt::format("Plan::from_string: line {}: malformed node line", line_no));
      }
      n.attention_core = core == 1;
      n.fused_attention = core == 2 || core == 3;
      n.cross_attention = core == 3;
      n.run_whole = core == 4;
      std::string edges;
      if (in >> edges) {
        if (d.children.size() != d.nodes.size()) {
          throw Error(fmt::format("Plan::from_string: line {}: edges on some node lines only", line_no));
        }
        auto& out = d.children.emplace_back();
        std::istringstream es(edges == "-" ? "" : edges);
        std::string item;
        while (std::getline(es, item, ',')) {
          char* end = nullptr;
          const long c = std::strtol(item.c_str(), &end, 10);
          if (item.empty() || *end != '\0' || c < -1 || c > 1'000'000'000) {
            throw Error(fmt::format("Plan::from_string: line {}: malformed edge '{}'", line_no, item));
          }
          out.push_back(static_cast<int32_t>(c));
        }
      } else if (!d.children.empty()) {
        throw Error(fmt::format("Plan::from_string: line {}: edges on some node lines only", line_no));
      }
      d.nodes.push_back(std::move(n));
    } else if (tag == "field") {
      if (d.nodes.empty()) throw Error(fmt::format("Plan::from_string: line {}: field before any node", line_no));
      detail::FieldSpec f;
      int kind = 0;
      if (!(in >> f.name >> kind >> f.item) || kind < 0 || kind > 3) {
        throw Error(fmt::format("Plan::from_string: line {}: malformed field line", line_no));
      }
      f.kind = static_cast<detail::FieldKind>(kind);
      f.shape = parse_shape(in, line_no);
      d.nodes.back().fields.push_back(std::move(f));
    } else if (tag == "insert") {
      detail::EdgeInsert ins;
      if (!(in >> ins.node >> ins.edge))
        throw Error(fmt::format("Plan::from_string: line {}: malformed insert", line_no));
      ins.shape = parse_shape(in, line_no);
      d.inserts.push_back(std::move(ins));
    } else if (tag == "detach") {
      detail::DetachedEdge e;
      if (!(in >> e.node >> e.edge) || e.node < 0 || e.edge < 0)
        throw Error(fmt::format("Plan::from_string: line {}: malformed detach", line_no));
      d.detached.push_back(e);
    } else if (tag == "blocker") {
      std::string why;
      std::getline(in >> std::ws, why);  // the rest of the line (a bare "blocker" has none)
      if (why.empty()) throw Error(fmt::format("Plan::from_string: line {}: blocker without its reason", line_no));
      d.exact_query_blocker = why;
    } else {
      throw Error(fmt::format("Plan::from_string: line {}: unknown record '{}'", line_no, tag));
    }
  }
  bool batched = false, one_row = false;
  for (const auto& v : plan.impl().variants) {
    (v.batch_a == 1 ? one_row : batched) = true;
    for (const auto& edges : v.children)
      for (int32_t c : edges)
        if (c >= static_cast<int32_t>(v.nodes.size())) {
          throw Error(fmt::format("Plan::from_string: edge to node {}, past the plan's {} nodes", c, v.nodes.size()));
        }
    for (const auto& n : v.nodes)
      for (const auto& f : n.fields)
        for (const auto& dim : f.shape.dims)
          if (dim.has_route() && (dim.route >= static_cast<int32_t>(v.nodes.size()) ||
                                  (detail::traits_of(v.nodes[dim.route].type).route != detail::RouteRole::kScatter &&
                                   detail::traits_of(v.nodes[dim.route].type).route != detail::RouteRole::kGather))) {
            throw Error(fmt::format(
                "Plan::from_string: node {} field {}: route {} is not an IndexAddBackward0 or IndexBackward0 node",
                n.type, f.name, dim.route));
          }
    for (const auto& e : v.detached)
      if (e.node >= static_cast<int32_t>(v.nodes.size()) ||
          detail::traits_of(v.nodes[e.node].type).sink != detail::SinkRole::kSubtract) {
        throw Error(fmt::format("Plan::from_string: detach of node {}, which is not a SubBackward0 node", e.node));
      }
  }
  if (!batched || !one_row) {
    throw Error("Plan::from_string: incomplete plan (expected variants for B > 1 and for B = 1)");
  }
  return plan;
}

}  // namespace collider
