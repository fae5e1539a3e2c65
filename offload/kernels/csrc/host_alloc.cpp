// torch's CPU allocator for the CPU backend: large blocks reused, little more mapped than was ever live.
//
// [Note: reusing activations' host memory]
// On the CPU backend a step's activations live in host memory: hundreds of tensors of a few MB, allocated
// in the forward, freed in the backward, the same sizes again next step. glibc serves them from its heap
// once its mmap threshold has risen, and the heap's free chunks keep their pages: RSS grew step after
// step past what was live. Mapping each one afresh (swap.buffers.map_large_allocations) keeps RSS honest
// but faults every page in again each step, a share of the CPU time that counts (bench/RESULTS.md, "activations'
// host memory reused").
//
// This allocator, installed as torch's CPU allocator while an engine runs on the CPU backend (from the end of
// its initialization: a unit's values while it is materialized are not a step's), maps each
// block of at least `threshold` bytes itself (its size rounded to pages) and on free keeps it for a later
// request of the same size. The bound: the bytes it has mapped (live + kept) never exceed the most that
// were live at once since it was opened by more than an eighth (at least 16 MiB); on a miss, kept blocks
// are unmapped, oldest first, until they fit. With no slack, a step whose sizes come and go in turn
// (one size freed before another is first needed) evicts a block it needs later in every step: the tiny
// preset mapped 2.6 MB afresh each step (tests/test_host_cache.py). When the last engine closes, every
// kept block is unmapped, frees of its blocks unmap at once, and new blocks come from the allocator it
// replaced (mapped afresh here, each one's pages were faulted in anew: torch work after close() ran 2.2x
// slower). Smaller blocks always go to that one. No tensor outlives it: the allocator is never destroyed.

#include <torch/extension.h>
#include <c10/core/CPUAllocator.h>

#include <pthread.h>
#include <sys/mman.h>

#include <algorithm>
#include <list>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

namespace {

constexpr size_t kPage = 4096;
// What may be mapped beyond the live peak: an eighth of it, at least 16 MiB (the Note above).
constexpr size_t kSlackDivisor = 8;
constexpr size_t kSlackMin = size_t(16) << 20;

struct Kept {
  size_t bytes;
  void* ptr;
};

class HostCache final : public c10::Allocator {
 public:
  HostCache(c10::Allocator* base, size_t threshold) : base_(base), threshold_(threshold) {}

  c10::DataPtr allocate(size_t n) override {
    if (n < threshold_) return base_->allocate(n);
    const size_t bytes = (n + kPage - 1) / kPage * kPage;
    std::vector<Kept> victims;
    void* ptr = nullptr;
    {
      std::lock_guard<std::mutex> g(mu_);
      if (opened_ == 0) return base_->allocate(n);  // no engine open: as before the first one
      ptr = take(bytes);
      live_ += bytes;
      peak_ = std::max(peak_, live_);
      if (ptr != nullptr) {
        reused_ += bytes;
      } else {
        fresh_ += bytes;
        while (!lru_.empty() && live_ + kept_ > bound()) victims.push_back(evict_oldest());
      }
    }
    unmap(victims);
    if (ptr == nullptr) {
      ptr = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (ptr == MAP_FAILED) {
        {
          std::lock_guard<std::mutex> g(mu_);
          live_ -= bytes;
          fresh_ -= bytes;
        }
        trim();
        return base_->allocate(n);  // its error says how much could not be allocated
      }
      std::lock_guard<std::mutex> g(mu_);
      sizes_[ptr] = bytes;
    }
    return {ptr, ptr, &HostCache::free_block, c10::Device(c10::DeviceType::CPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &HostCache::free_block; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  // A pointer from raw_allocate may be the replaced allocator's (a small block).
  void release(void* ptr) {
    size_t bytes = 0;
    bool keep = false;
    {
      std::lock_guard<std::mutex> g(mu_);
      auto it = sizes_.find(ptr);
      if (it != sizes_.end()) {
        bytes = it->second;
        live_ -= bytes;
        keep = opened_ > 0;
        if (keep) {
          lru_.push_back({bytes, ptr});
          by_size_[bytes].push_back(std::prev(lru_.end()));
          kept_ += bytes;
        } else {
          sizes_.erase(it);
        }
      }
    }
    if (bytes == 0) {
      c10::DeleterFnPtr base_free = base_->raw_deleter();
      if (base_free != nullptr) base_free(ptr);
    } else if (!keep) {
      munmap(ptr, bytes);
    }
  }

  void open() {
    std::lock_guard<std::mutex> g(mu_);
    if (opened_++ == 0) peak_ = live_;
  }

  void close() {
    {
      std::lock_guard<std::mutex> g(mu_);
      if (opened_ > 0) --opened_;
      if (opened_ > 0) return;
    }
    trim();
  }

  size_t trim() {
    std::vector<Kept> victims;
    {
      std::lock_guard<std::mutex> g(mu_);
      while (!lru_.empty()) victims.push_back(evict_oldest());
    }
    size_t freed = 0;
    for (const Kept& k : victims) freed += k.bytes;
    unmap(victims);
    return freed;
  }

  std::vector<std::pair<std::string, size_t>> stats() {
    std::lock_guard<std::mutex> g(mu_);
    return {{"live_bytes", live_}, {"kept_bytes", kept_}, {"peak_live_bytes", peak_},
            {"mapped_fresh_bytes", fresh_}, {"reused_bytes", reused_}, {"threshold_bytes", threshold_},
            {"engines", opened_}};
  }

  void lock() { mu_.lock(); }
  void unlock() { mu_.unlock(); }
  static void free_block(void* ptr);

 private:
  size_t bound() const { return peak_ + std::max(peak_ / kSlackDivisor, kSlackMin); }  // under mu_

  void* take(size_t bytes) {  // under mu_
    auto it = by_size_.find(bytes);
    if (it == by_size_.end() || it->second.empty()) return nullptr;
    auto kept = it->second.back();
    it->second.pop_back();
    void* ptr = kept->ptr;
    lru_.erase(kept);
    kept_ -= bytes;
    return ptr;
  }

  Kept evict_oldest() {  // under mu_, lru_ not empty
    auto oldest = lru_.begin();
    Kept k = *oldest;
    auto& same = by_size_[k.bytes];
    same.erase(std::find(same.begin(), same.end(), oldest));
    lru_.erase(oldest);
    kept_ -= k.bytes;
    sizes_.erase(k.ptr);
    return k;
  }

  static void unmap(const std::vector<Kept>& blocks) {
    for (const Kept& k : blocks) munmap(k.ptr, k.bytes);
  }

  c10::Allocator* base_;
  const size_t threshold_;
  std::mutex mu_;
  std::unordered_map<void*, size_t> sizes_;  // every block mapped here, live or kept -> its bytes
  std::list<Kept> lru_;                      // kept blocks, the oldest freed first
  std::unordered_map<size_t, std::vector<std::list<Kept>::iterator>> by_size_;
  size_t live_ = 0, kept_ = 0, peak_ = 0, fresh_ = 0, reused_ = 0, opened_ = 0;
};

HostCache* g_cache = nullptr;
std::mutex g_install;

void HostCache::free_block(void* ptr) { g_cache->release(ptr); }

// A fork while another thread holds the lock would leave it held in the child (a DataLoader worker).
void before_fork() { g_cache->lock(); }
void after_fork() { g_cache->unlock(); }

// Installs the allocator (once; the first call's threshold stays) and counts an engine as open; false if
// another allocator of a higher priority holds torch's CPU slot (then nothing changes).
bool host_cache_open(size_t threshold) {
  std::lock_guard<std::mutex> g(g_install);
  if (g_cache == nullptr) {
    auto* cache = new HostCache(c10::GetCPUAllocator(), threshold);
    c10::SetCPUAllocator(cache, /*priority=*/1);
    if (c10::GetCPUAllocator() != cache) {
      delete cache;
      return false;
    }
    g_cache = cache;
    pthread_atfork(before_fork, after_fork, after_fork);
  }
  g_cache->open();
  return true;
}

void host_cache_close() {
  std::lock_guard<std::mutex> g(g_install);
  if (g_cache != nullptr) g_cache->close();
}

std::vector<std::pair<std::string, size_t>> host_cache_stats() {
  std::lock_guard<std::mutex> g(g_install);
  if (g_cache == nullptr) return {};
  return g_cache->stats();
}

}  // namespace

void bind_host_alloc(pybind11::module_& m) {
  namespace py = pybind11;
  m.def("host_cache_open", &host_cache_open);
  m.def("host_cache_close", &host_cache_close, py::call_guard<py::gil_scoped_release>());
  m.def("host_cache_stats", &host_cache_stats);
}
