// The distinct experts among a call's top-k ids: the one counter the decode step's layers
// (DecodeLayers), the routing summary of a step and the native expert store share. Header-only:
// the CPU MoE extension and the expert loader's are built apart.
#pragma once

#include <cstdint>
#include <vector>

namespace moebench_experts {

class DistinctExperts {
 public:
  void resize(int64_t num_experts) {
    marks_.assign(static_cast<size_t>(num_experts), 0);
    list_.clear();
  }

  // Marks the experts of ids[0, n) (each in [0, num_experts): the caller checked) and lists each one
  // once, in the order first seen; returns how many there are. The marks of the last call are cleared
  // first, so scratch is kept between calls without a pass over every expert.
  int64_t mark(const int64_t* ids, int64_t n) {
    for (int e : list_) marks_[e] = 0;
    list_.clear();
    for (int64_t i = 0; i < n; ++i) {
      const int64_t e = ids[i];
      if (!marks_[e]) {
        marks_[e] = 1;
        list_.push_back(static_cast<int>(e));
      }
    }
    return static_cast<int64_t>(list_.size());
  }

  const std::vector<char>& marks() const { return marks_; }  // 1 for each expert of the last call
  std::vector<int>& list() { return list_; }                  // those experts (the caller may sort them)

 private:
  std::vector<char> marks_;
  std::vector<int> list_;
};

}  // namespace moebench_experts
