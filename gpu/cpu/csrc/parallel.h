// Splitting a kernel's items over torch's threads so that one thread held up does not hold up
// the rest.
//
// at::parallel_for gives each thread a fixed share and ends with a barrier. On a host whose
// cores also run the HTTP event loop and the clients, the OS often preempts one of the kernel's
// threads mid-share: the others then finish theirs and wait at the barrier for it, so a
// 50-microsecond interruption costs every core 50 microseconds.
//
// parallel_items keeps the same contiguous shares, each taken in order by its thread (which its
// prefetching counts on), but a thread that finishes its own share goes on taking items from
// the far end of the others': a preempted thread delays the end of the region by at most the
// item it is working on. Items taken from the far end go backwards, so a kernel that prefetches
// the next item's data fetches nothing useful for them (stealing is the rare case). Items are
// numbered below 2^31.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>

namespace tidal {

// One thread's share of items [front, back), both ends in one atomic word so that the owner
// can take from the front while others take from the back.
class Share {
 public:
  void assign(int64_t front, int64_t back) {
    range_.store(pack(front, back), std::memory_order_relaxed);
  }
  // The owner's next item, in order, or -1.
  int64_t take_front() { return take(true); }
  // An item from the far end, away from where the owner works and prefetches, or -1.
  int64_t take_back() { return take(false); }

 private:
  static uint64_t pack(int64_t front, int64_t back) {
    return (static_cast<uint64_t>(front) << 32) | static_cast<uint32_t>(back);
  }
  int64_t take(bool from_front) {
    uint64_t range = range_.load(std::memory_order_relaxed);
    for (;;) {
      const int64_t front = static_cast<int64_t>(range >> 32);
      const int64_t back = static_cast<int64_t>(range & 0xFFFFFFFFu);
      if (front >= back) return -1;
      const uint64_t rest = from_front ? pack(front + 1, back) : pack(front, back - 1);
      if (range_.compare_exchange_weak(range, rest, std::memory_order_relaxed))
        return from_front ? front : back - 1;
    }
  }
  alignas(64) std::atomic<uint64_t> range_{0};
};

// The items one thread works on: its own share first, then what is left of the others'.
class ItemSource {
 public:
  ItemSource(Share* shares, int64_t count, int64_t self)
      : shares_(shares), count_(count), self_(self) {}

  // The next item to do, or -1 when every share is used up.
  int64_t next() {
    for (; visited_ < count_; ++visited_) {
      Share& share = shares_[(self_ + visited_) % count_];
      const int64_t item = visited_ == 0 ? share.take_front() : share.take_back();
      if (item >= 0) return item;
    }
    return -1;
  }

 private:
  Share* shares_;
  int64_t count_, self_, visited_ = 0;
};

// Runs work(source) on every thread of torch's pool, each drawing items of [0, n) from its
// own ItemSource until none is left. Inside a parallel region, or with one thread, the calling
// thread does every item.
template <typename Work>
void parallel_items(int64_t n, const Work& work) {
  if (n <= 0) return;
  TORCH_CHECK(n < (int64_t{1} << 31), "parallel_items: ", n, " items, at most 2^31 - 1");
  const int64_t threads =
      at::in_parallel_region() ? 1 : std::min<int64_t>(at::get_num_threads(), n);
  std::unique_ptr<Share[]> shares(new Share[threads]);
  for (int64_t t = 0; t < threads; ++t) shares[t].assign(n * t / threads, n * (t + 1) / threads);
  if (threads == 1) {
    ItemSource source(shares.get(), 1, 0);
    work(source);
    return;
  }
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      ItemSource source(shares.get(), threads, t);
      work(source);
    }
  });
}

}  // namespace tidal
