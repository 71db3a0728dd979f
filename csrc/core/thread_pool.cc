#include "core/thread_pool.h"

#include <pthread.h>

#include <atomic>
#include <exception>
#include <memory>

namespace recsave {

ThreadPool::ThreadPool(int num_threads) {
  if (num_threads < 0) num_threads = 0;
  workers_.reserve(num_threads);
  for (int i = 0; i < num_threads; ++i) workers_.emplace_back([this] { worker_loop(); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::submit(std::function<void()> job) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    jobs_.push(std::move(job));
  }
  cv_.notify_one();
}

void ThreadPool::worker_loop() {
  for (;;) {
    std::function<void()> job;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] { return stopping_ || !jobs_.empty(); });
      if (jobs_.empty()) return;  // stopping and drained
      job = std::move(jobs_.front());
      jobs_.pop();
    }
    job();
  }
}

void ThreadPool::parallel_for(int64_t n, int parallelism, const std::function<void(int64_t)>& fn) {
  if (n <= 0) return;
  int helpers = parallelism - 1;
  if (helpers > size()) helpers = size();
  if (helpers > n - 1) helpers = static_cast<int>(n - 1);
  if (helpers <= 0) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }

  // Shared state lives on the heap so a late helper never touches a dead stack frame.
  struct State {
    std::atomic<int64_t> next{0};
    std::atomic<bool> failed{false};
    std::exception_ptr error;
    std::mutex mu;
    std::condition_variable done_cv;
    int running = 0;
  };
  auto state = std::make_shared<State>();
  auto drain = [state, n, &fn] {
    for (;;) {
      if (state->failed.load(std::memory_order_relaxed)) return;
      int64_t i = state->next.fetch_add(1);
      if (i >= n) return;
      // The error is handed over after the catch block has ended and under the mutex, and the
      // caller moves it out under the mutex too: an exception object's refcount lives in the
      // (uninstrumented) C++ runtime, so every hand-over must be ordered by the mutex for
      // ThreadSanitizer to see it.
      std::exception_ptr caught;
      try {
        fn(i);
      } catch (...) {
        caught = std::current_exception();
      }
      if (caught) {
        std::lock_guard<std::mutex> lock(state->mu);
        if (!state->error) state->error = std::move(caught);
        state->failed = true;
      }
    }
  };
  state->running = helpers;
  for (int h = 0; h < helpers; ++h) {
    submit([state, drain] {
      drain();
      std::lock_guard<std::mutex> lock(state->mu);
      if (--state->running == 0) state->done_cv.notify_all();
    });
  }
  drain();
  std::exception_ptr error;
  {
    std::unique_lock<std::mutex> lock(state->mu);
    state->done_cv.wait(lock, [&] { return state->running == 0; });
    error = std::move(state->error);
  }
  if (error) std::rethrow_exception(error);
}

namespace {

// The shared pools. A forked child inherits this memory but not the worker threads (nor a mutex a
// parent thread may have held), so the child starts a fresh registry and leaks the old one.
struct PoolRegistry {
  std::mutex mu;
  std::vector<std::unique_ptr<ThreadPool>> pools;
};
std::atomic<PoolRegistry*> g_registry{nullptr};

void reset_after_fork() { g_registry.store(new PoolRegistry()); }

}  // namespace

ThreadPool& shared_pool(int min_threads) {
  static std::once_flag once;
  std::call_once(once, [] {
    g_registry.store(new PoolRegistry());
    pthread_atfork(nullptr, nullptr, reset_after_fork);
  });
  PoolRegistry* registry = g_registry.load();
  std::lock_guard<std::mutex> lock(registry->mu);
  if (min_threads < 1) min_threads = 1;
  auto& pools = registry->pools;
  if (pools.empty() || pools.back()->size() < min_threads) {
    pools.push_back(std::make_unique<ThreadPool>(min_threads));
  }
  return *pools.back();
}

}  // namespace recsave
