// The native expert store: the row bookkeeping of `PooledStore` (engine/expert_store.py, the
// reference this is tested against, call for call) in C++ beside the native loader, so that a fetch
// whose experts are all resident is one call that looks the rows up, with no Python loop, and a miss
// is described and loaded from here without going back to Python.
//
// Per MoE layer: which expert each held row has (a table, -1 where none, and an LRU list), loads in
// flight (the loader's Load objects, cancelled or waited for here), the experts prefetched for the
// layer's next call and the ones predicted for it. For the store: the free rows, the layers in the
// order they last ran (the order in which a claim borrows rows), the counters. The weights stay in
// the two buffers Python allocated; this only knows their addresses.
//
// Every rule (victim choice, borrowing order, cancellation, what counts as a hit, a late hit or an
// eviction) is the reference's; where the two differ, the reference is right and this is a bug.
#include <ATen/EmptyTensor.h>

#include <algorithm>

#include "distinct_experts.h"
#include "expert_loader.h"

namespace moebench_loader {
namespace {

// One part of an expert's load: bytes at `src` (an address, or an offset into what a file read
// returned) land at offset `at` of the row of w13 (into = 0) or w2 (into = 1), converted by `kind`.
struct Part {
  int64_t src;
  int into;
  int64_t at;
  int64_t bytes;
  int kind;
};

// An expert's load with the row left open: the tier's description, made once at construction.
struct Template {
  int fd;
  int64_t offset, length, needed;
  bool fadvise;
  std::string label;
  std::vector<Part> parts;
};

// Counters, in the reference's names; the first kStepKeys are also counted per step (take_step).
enum Key : int {
  kHits, kMisses, kIssued, kPrefetchHits, kBytes, kStepKeys,
  kLookups = kStepKeys, kLateHits, kEvictions, kOverflow, kCancelled, kPredicted, kNeededPredicted,
  kPredictedNeeded, kBorrowed, kNoRoom, kNumKeys
};
const char* const kKeyNames[kNumKeys] = {
    "expert_hits", "expert_misses", "prefetch_issued", "prefetch_hits", "bytes_loaded", "lookups",
    "late_hits", "evictions", "overflow_calls", "cancelled", "predicted", "needed_predicted",
    "predicted_needed", "borrowed", "prefetch_no_room"};

// One MoE layer's share of the rows.
struct Pool {
  int layer = 0;
  std::vector<int64_t> table;  // expert -> row, resident or loading; -1: not held
  // held experts as a doubly linked list, least recently used at head
  std::vector<int> prev, next;
  int head = -1, tail = -1, held = 0;
  std::vector<std::shared_ptr<Load>> loading;  // expert -> its load in flight, or null
  std::vector<int> loading_order;              // experts with a load in flight, in issue order
  std::vector<char> prefetched;                // loaded by prefetch for the next call, not yet used
  std::vector<int> prefetched_list;            // a superset of the flagged ones, to clear them
  std::vector<char> predicted;                 // what the prefetcher predicted for the next call
  std::vector<int> predicted_list;
  bool has_prediction = false;
  std::vector<Template> templates;  // one per expert

  void unlink(int e) {
    (prev[e] >= 0 ? next[prev[e]] : head) = next[e];
    (next[e] >= 0 ? prev[next[e]] : tail) = prev[e];
    prev[e] = next[e] = -1;
    --held;
  }
  void append(int e) {  // as the most recently used
    prev[e] = tail;
    next[e] = -1;
    (tail >= 0 ? next[tail] : head) = e;
    tail = e;
    ++held;
  }
  void touch(int e) {
    if (tail != e) {
      unlink(e);
      append(e);
    }
  }
  void clear_prediction() {
    for (int e : predicted_list) predicted[e] = 0;
    predicted_list.clear();
    has_prediction = false;
  }
  void stop_loading(int e) {
    loading[e].reset();
    loading_order.erase(std::find(loading_order.begin(), loading_order.end(), e));
  }
};

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

Template parse_template(const py::tuple& t) {
  // (fd, offset, length, needed, fadvise, label, [(src, into, at, bytes, kind), ...])
  Template out{t[0].cast<int>(), t[1].cast<int64_t>(), t[2].cast<int64_t>(), t[3].cast<int64_t>(),
               t[4].cast<bool>(), t[5].cast<std::string>(), {}};
  for (const auto& item : t[6].cast<py::list>()) {
    auto p = item.cast<py::tuple>();
    out.parts.push_back({p[0].cast<int64_t>(), p[1].cast<int>(), p[2].cast<int64_t>(), p[3].cast<int64_t>(),
                         p[4].cast<int>()});
  }
  return out;
}

class Store {
 public:
  // layers: per MoE layer (layer, [(expert, row), ...] least recently used first, [template per expert]);
  // free_rows: popped from the back; recent: MoE layers, the most recently fetched first. prefetch,
  // demand: loaders with threads, or None; sync: the loader whose counters the caller's own loads feed.
  Store(int64_t num_experts, int64_t rows, int64_t quota, int64_t expert_bytes, int64_t w13_base, int64_t w2_base,
        int64_t w13_row_bytes, int64_t w2_row_bytes, const py::list& layers, std::vector<int64_t> free_rows,
        const std::vector<int>& recent, const Loader* prefetch, const Loader* demand, const Loader& sync)
      : E_(static_cast<int>(num_experts)), quota_(quota), expert_bytes_(expert_bytes),
        base_{w13_base, w2_base}, row_bytes_{w13_row_bytes, w2_row_bytes}, free_(std::move(free_rows)),
        prefetch_(prefetch ? prefetch->queue_for_store() : nullptr),
        demand_(demand ? demand->queue_for_store() : nullptr), sync_(sync.counters_queue()) {
    pools_.reserve(layers.size());
    for (const auto& item : layers) {
      auto t = item.cast<py::tuple>();
      Pool p;
      p.layer = t[0].cast<int>();
      p.table.assign(E_, -1);
      p.prev.assign(E_, -1);
      p.next.assign(E_, -1);
      p.loading.resize(E_);
      p.prefetched.assign(E_, 0);
      p.predicted.assign(E_, 0);
      for (const auto& pair : t[1].cast<py::list>()) {
        auto er = pair.cast<std::pair<int, int64_t>>();
        check_expert(er.first);
        p.table[er.first] = er.second;
        p.append(er.first);
      }
      for (const auto& tmpl : t[2].cast<py::list>()) p.templates.push_back(parse_template(tmpl.cast<py::tuple>()));
      if (static_cast<int>(p.templates.size()) != E_) throw std::invalid_argument("one load template per expert");
      if (p.layer >= static_cast<int>(index_.size())) index_.resize(p.layer + 1, -1);
      index_[p.layer] = static_cast<int>(pools_.size());
      pools_.push_back(std::move(p));
    }
    for (int layer : recent) recent_.push_back(&pool(layer));
    if (recent_.size() != pools_.size()) throw std::invalid_argument("recent must name every MoE layer once");
    int64_t accounted = static_cast<int64_t>(free_.size());
    for (const Pool& p : pools_) accounted += p.held;
    if (accounted != rows) throw std::invalid_argument("every row must be free or held by one layer");
    need_.resize(E_);
    reset_step();
    std::fill(std::begin(total_), std::end(total_), 0);
  }

  // The MoE block's call: the rows holding `ids`' experts, loading what is missing.
  torch::Tensor fetch(int layer, const torch::Tensor& topk_ids) {
    TORCH_CHECK(topk_ids.device().is_cpu(), "the native expert store runs on CPU");
    // (each ATen call here goes through the dispatcher, a cost a hit should not pay: none where the
    // ids are as they come; docs/prefetch.md)
    const bool as_is = topk_ids.scalar_type() == torch::kLong && topk_ids.is_contiguous();
    const torch::Tensor ids = as_is ? topk_ids : topk_ids.to(torch::kLong).contiguous();
    const int64_t* id = ids.data_ptr<int64_t>();
    const int64_t n = ids.numel();
    Pool& p = pool(layer);
    // scratch kept between calls (no allocation on a hit), cleared here so a call that threw leaves none
    for (int64_t i = 0; i < n; ++i) check_expert(id[i]);
    const int64_t distinct = need_.mark(id, n);
    const std::vector<char>& need = need_.marks();
    std::vector<int>& needed = need_.list();
    std::sort(needed.begin(), needed.end());
    add(kLookups, distinct);
    if (distinct > quota_) add(kOverflow, 1);
    score_prediction(p, needed);
    if (!p.loading_order.empty()) drop_unneeded_loads(p, need);
    int64_t prefetch_hits = 0;
    for (int e : p.prefetched_list) {
      prefetch_hits += p.prefetched[e] && need[e];
      p.prefetched[e] = 0;
    }
    p.prefetched_list.clear();
    add(kPrefetchHits, prefetch_hits);
    double stall = 0.0;
    std::vector<int>& misses = misses_;
    misses.clear();
    for (int e : needed) {
      if (p.table[e] >= 0) {
        p.touch(e);
        if (p.loading[e]) {
          auto load = p.loading[e];
          p.stop_loading(e);
          stall += wait(*load, *prefetch_);
        }
      } else {
        misses.push_back(e);
      }
    }
    add(kHits, distinct - static_cast<int64_t>(misses.size()));
    if (!misses.empty()) stall += load_misses(p, misses, need);
    step_stall_ += stall;
    total_stall_ += stall;
    if (recent_.front() != &p) {
      auto it = std::find(recent_.begin(), recent_.end(), &p);
      std::rotate(recent_.begin(), it, it + 1);
    }
    torch::Tensor rows = at::detail::empty_cpu(ids.sizes(), torch::kLong, false, c10::nullopt);
    int64_t* out = rows.data_ptr<int64_t>();
    for (int64_t i = 0; i < n; ++i) out[i] = p.table[id[i]];
    return rows;
  }

  // Start loading `experts` (distinct, most wanted first) for `layer`'s next call (the reference's
  // `prefetch`: predicted residents become most recently used, the rest go to rows `claim` finds).
  void prefetch(int layer, const std::vector<int64_t>& experts) {
    if (!prefetch_) return;
    Pool& p = pool(layer);
    for (int64_t e : experts) check_expert(e);
    if (p.has_prediction &&
        std::all_of(experts.begin(), experts.end(), [&](int64_t e) { return p.predicted[e] != 0; }))
      return;  // the late guess often repeats the early one: all of it is resident or on its way
    if (!p.has_prediction) p.clear_prediction();
    p.has_prediction = true;
    for (int64_t e : experts) {
      if (!p.predicted[e]) {
        p.predicted[e] = 1;
        p.predicted_list.push_back(static_cast<int>(e));
      }
    }
    for (auto it = experts.rbegin(); it != experts.rend(); ++it)
      if (p.table[*it] >= 0) p.touch(static_cast<int>(*it));
    std::vector<std::pair<int, int64_t>> loads;
    for (int64_t e : experts) {
      if (p.table[e] >= 0) continue;
      const int64_t row = claim(p, static_cast<int>(e), p.predicted.data(), false);
      if (row < 0) {
        add(kNoRoom, 1);
        break;
      }
      loads.emplace_back(static_cast<int>(e), row);
    }
    if (loads.empty()) return;
    std::vector<std::shared_ptr<Load>> batch;
    for (const auto& [e, row] : loads) batch.push_back(describe(p, e, row));
    prefetch_->enqueue(batch);
    for (size_t i = 0; i < loads.size(); ++i) {
      const int e = loads[i].first;
      p.loading[e] = batch[i];
      p.loading_order.push_back(e);
      if (!p.prefetched[e]) {
        p.prefetched[e] = 1;
        p.prefetched_list.push_back(e);
      }
    }
    add(kIssued, static_cast<int64_t>(loads.size()));
    add(kBytes, static_cast<int64_t>(loads.size()) * expert_bytes_);
  }

  // Wait until every load in flight has ended (the GIL released), leaving the bookkeeping as it is:
  // tests use it to take the timing out of which loads a later call finds done.
  void settle() {
    for (Pool& p : pools_)
      for (int e : p.loading_order) {
        Load& load = *p.loading[e];
        if (load.state.load(std::memory_order_acquire) < kDone) {
          py::gil_scoped_release no_gil;
          prefetch_->wait(load);
        }
      }
  }

  py::dict take_step() {
    py::dict out = counters(step_, step_stall_, kStepKeys);
    reset_step();
    return out;
  }
  py::dict totals() const { return counters(total_, total_stall_, kNumKeys); }

  // For tests and checks: the state the reference keeps in Python.
  std::vector<int64_t> table(int layer) { return pool(layer).table; }
  std::vector<std::pair<int, int64_t>> held(int layer) {  // (expert, row), least recently used first
    Pool& p = pool(layer);
    std::vector<std::pair<int, int64_t>> out;
    for (int e = p.head; e >= 0; e = p.next[e]) out.emplace_back(e, p.table[e]);
    return out;
  }
  std::vector<int> loading(int layer) { return pool(layer).loading_order; }
  py::object predicted(int layer) {
    Pool& p = pool(layer);
    if (!p.has_prediction) return py::none();
    py::set out;
    for (int e : p.predicted_list) out.add(e);
    return out;
  }
  std::vector<int64_t> free_rows() const { return free_; }
  std::vector<int> recent() const {
    std::vector<int> out;
    for (const Pool* p : recent_) out.push_back(p->layer);
    return out;
  }

 private:
  Pool& pool(int layer) {
    if (layer < 0 || layer >= static_cast<int>(index_.size()) || index_[layer] < 0)
      throw std::out_of_range("layer " + std::to_string(layer) + " is not a MoE layer of this store");
    return pools_[index_[layer]];
  }
  void check_expert(int64_t e) const {
    if (e < 0 || e >= E_) throw std::out_of_range("expert id " + std::to_string(e) + " out of range");
  }
  void add(Key key, int64_t value) {
    if (key < kStepKeys) step_[key] += value;
    total_[key] += value;
  }
  void reset_step() {
    std::fill(std::begin(step_), std::end(step_), 0);
    step_stall_ = 0.0;
  }
  static py::dict counters(const int64_t* values, double stall, int count) {
    py::dict out;
    for (int k = 0; k < count; ++k) {
      out[kKeyNames[k]] = values[k];
      if (k == kStepKeys - 1) out["stall_s"] = stall;  // in the reference's order
    }
    return out;
  }

  std::shared_ptr<Load> describe(const Pool& p, int expert, int64_t row) const {
    const Template& t = p.templates[expert];
    auto load = std::make_shared<Load>();
    load->fd = t.fd;
    load->offset = t.offset;
    load->length = t.length;
    load->needed = t.needed;
    load->fadvise = t.fadvise;
    load->label = t.label;
    for (const Part& part : t.parts)
      load->segments.push_back(
          {part.src, base_[part.into] + row * row_bytes_[part.into] + part.at, part.bytes, part.kind});
    return load;
  }

  // Wait for a load (the GIL released) and raise its error if it failed.
  static void finish(Load& load, Queue& queue) {
    if (load.state.load(std::memory_order_acquire) < kDone) {
      py::gil_scoped_release no_gil;
      queue.wait(load);
    }
    const int state = load.state.load();
    if (state == kFailed) throw LoadError(load.error);
    if (state == kCancelled) throw LoadError("the load was cancelled");
  }

  // -> seconds waited (stall); a load still running is a late hit.
  double wait(Load& load, Queue& queue) {
    if (load.state.load(std::memory_order_acquire) >= kDone) {
      finish(load, queue);
      return 0.0;
    }
    add(kLateHits, 1);
    const auto t0 = Clock::now();
    finish(load, queue);
    return seconds_since(t0);
  }

  bool cancel(Load& load) {
    if (!prefetch_->cancel(load)) return false;
    add(kBytes, -expert_bytes_);  // counted when issued, never read
    add(kCancelled, 1);
    return true;
  }

  int64_t evict(Pool& p, int expert) {
    const int64_t row = p.table[expert];
    p.unlink(expert);
    p.table[expert] = -1;
    p.prefetched[expert] = 0;
    add(kEvictions, 1);
    return row;
  }

  // The row of p's least recently used expert outside `keep` whose row is not being written; with
  // `force`, a load in flight is cancelled or waited out instead of skipped. -1: none.
  int64_t evict_lru(Pool& p, const char* keep, bool force) {
    for (int x = p.head; x >= 0; x = p.next[x]) {
      if (keep != nullptr && keep[x]) continue;
      if (p.loading[x]) {
        Load& load = *p.loading[x];
        if (load.state.load(std::memory_order_acquire) < kDone && !force) continue;
        if (!cancel(load)) finish(load, *prefetch_);
        p.stop_loading(x);
      }
      return evict(p, x);
    }
    return -1;
  }

  // A row for `own`'s `expert` (the reference's `_claim`): a free one; else, while the layer holds
  // its quota, its own least recently used expert outside `protect`; else one borrowed from the
  // other layers, those over their quota first, the most recently run first, never an expert of
  // their pending prediction; a demand claim then takes any row, waiting out loads if it must.
  int64_t claim(Pool& own, int expert, const char* protect, bool demand) {
    int64_t row = -1;
    if (!free_.empty()) {
      row = free_.back();
      free_.pop_back();
    } else {
      std::vector<Pool*> others, over, rest, order;
      for (Pool* q : recent_) {
        if (q == &own) continue;
        others.push_back(q);
        (q->held > quota_ ? over : rest).push_back(q);
      }
      if (own.held >= quota_) {
        order.push_back(&own);
        order.insert(order.end(), over.begin(), over.end());
      } else {
        order = over;
        order.push_back(&own);
      }
      order.insert(order.end(), rest.begin(), rest.end());
      const Pool* from = nullptr;
      for (Pool* q : order) {
        const char* keep = q == &own ? protect : (q->has_prediction ? q->predicted.data() : nullptr);
        row = evict_lru(*q, keep, false);
        if (row >= 0) {
          from = q;
          break;
        }
      }
      if (row < 0 && demand) {
        order.assign(1, &own);
        order.insert(order.end(), others.begin(), others.end());
        for (Pool* q : order) {
          row = evict_lru(*q, q == &own ? protect : nullptr, true);
          if (row >= 0) {
            from = q;
            break;
          }
        }
      }
      if (row < 0) {
        if (demand) throw std::logic_error("expert store: no row for a demand load (the rows hold fewer than a layer's experts?)");
        return -1;
      }
      if (from != &own) add(kBorrowed, 1);
    }
    own.table[expert] = row;
    own.append(expert);
    return row;
  }

  // Prefetches for this call that turned out wrong and have not started cost nothing: cancel them
  // and give their rows back.
  void drop_unneeded_loads(Pool& p, const std::vector<char>& need) {
    std::vector<int> unneeded;
    for (int e : p.loading_order)
      if (!need[e]) unneeded.push_back(e);
    for (int e : unneeded) {
      if (cancel(*p.loading[e])) {
        p.stop_loading(e);
        free_.push_back(evict(p, e));
        add(kEvictions, -1);  // never held an expert
      }
    }
  }

  void score_prediction(Pool& p, const std::vector<int>& needed) {
    if (!p.has_prediction) return;
    int64_t both = 0;
    for (int e : needed) both += p.predicted[e] != 0;
    add(kPredicted, static_cast<int64_t>(p.predicted_list.size()));
    add(kNeededPredicted, static_cast<int64_t>(needed.size()));
    add(kPredictedNeeded, both);
    p.clear_prediction();
  }

  // Load the call's missing experts on demand (the reference's `_load_misses`): on the demand
  // loader's threads where there is one and more than one miss, else one at a time in this thread.
  // -> seconds spent, claims included.
  double load_misses(Pool& p, const std::vector<int>& misses, const std::vector<char>& need) {
    const int64_t m = static_cast<int64_t>(misses.size());
    add(kMisses, m);
    add(kBytes, m * expert_bytes_);
    const auto t0 = Clock::now();
    std::vector<std::shared_ptr<Load>> batch;
    for (int e : misses) batch.push_back(describe(p, e, claim(p, e, need.data(), true)));
    if (demand_ && m > 1) {
      demand_->enqueue(batch);
      for (auto& load : batch) finish(*load, *demand_);
    } else {
      py::gil_scoped_release no_gil;
      for (auto& load : batch) run_load(*load, caller_buffer(), sync_->counters);
    }
    return seconds_since(t0);
  }

  int E_;
  int64_t quota_, expert_bytes_;
  int64_t base_[2], row_bytes_[2];
  std::vector<Pool> pools_;
  std::vector<int> index_;      // layer -> index into pools_, -1: not a MoE layer
  std::vector<Pool*> recent_;   // the most recently fetched first
  std::vector<int64_t> free_;   // taken from the back
  std::shared_ptr<Queue> prefetch_, demand_, sync_;
  moebench_experts::DistinctExperts need_;  // fetch's scratch: the call's experts (flags, and sorted)
  std::vector<int> misses_;
  int64_t step_[kNumKeys], total_[kNumKeys];
  double step_stall_ = 0.0, total_stall_ = 0.0;
};

}  // namespace

void register_store(py::module_& m) {
  py::class_<Store>(m, "Store")
      .def(py::init<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, const py::list&,
                    std::vector<int64_t>, const std::vector<int>&, const Loader*, const Loader*, const Loader&>(),
           py::arg("num_experts"), py::arg("rows"), py::arg("quota"), py::arg("expert_bytes"), py::arg("w13_base"),
           py::arg("w2_base"), py::arg("w13_row_bytes"), py::arg("w2_row_bytes"), py::arg("layers"),
           py::arg("free_rows"), py::arg("recent"), py::arg("prefetch").none(true), py::arg("demand").none(true),
           py::arg("sync"))
      .def("fetch", &Store::fetch, py::arg("layer"), py::arg("topk_ids"),
           "The rows holding topk_ids' experts (same shape, int64), loading the missing ones.")
      .def("prefetch", &Store::prefetch, py::arg("layer"), py::arg("experts"))
      .def("settle", &Store::settle, "Wait until every load in flight has ended (bookkeeping unchanged).")
      .def("take_step", &Store::take_step)
      .def("totals", &Store::totals)
      .def("table", &Store::table)
      .def("held", &Store::held, "(expert, row) pairs a layer holds, least recently used first.")
      .def("loading", &Store::loading)
      .def("predicted", &Store::predicted)
      .def("free_rows", &Store::free_rows)
      .def("recent", &Store::recent);
}

}  // namespace moebench_loader
