// A fixed pool of worker threads with a parallel-for that propagates the first exception.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <queue>
#include <thread>
#include <vector>

namespace recsave {

class ThreadPool {
 public:
  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return static_cast<int>(workers_.size()); }

  // Runs fn(i) for every i in [0, n) on at most `parallelism` threads (the caller counts as one and
  // works too). Tasks are taken in increasing order. Returns when all are done; if any task threw,
  // the remaining tasks are skipped and the first exception is rethrown here.
  void parallel_for(int64_t n, int parallelism, const std::function<void(int64_t)>& fn);

 private:
  void submit(std::function<void()> job);
  void worker_loop();

  std::vector<std::thread> workers_;
  std::queue<std::function<void()>> jobs_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;
};

// A process-wide pool grown on demand to at least `min_threads` workers. The pools of earlier,
// smaller requests stay alive (threads are cheap while idle), so pointers remain valid.
ThreadPool& shared_pool(int min_threads);

}  // namespace recsave
