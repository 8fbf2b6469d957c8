// Host backend of the stream/event interface: bookkeeping only, the host runs in order.
#include <atomic>
#include <mutex>
#include <unordered_set>

#include "gpipe_fast/device.hpp"
#include "gpipe_fast/error.hpp"

namespace gpipe_fast {
namespace {

class HostSync final : public StreamSync {
 public:
  std::string name() const override { return "host"; }

  EventId record(const Stream&) override {
    std::lock_guard<std::mutex> lock(mutex_);
    const EventId id = next_++;
    live_.insert(id);
    return id;
  }

  void wait(const Stream&, EventId event) override { check_live(event); }
  void synchronize(EventId event) override { check_live(event); }

  void release(EventId event) override {
    std::lock_guard<std::mutex> lock(mutex_);
    GF_EXPECTS(live_.erase(event) == 1, "release of unknown event " + std::to_string(event));
  }

  std::int64_t live_events() const override {
    std::lock_guard<std::mutex> lock(mutex_);
    return static_cast<std::int64_t>(live_.size());
  }
  std::int64_t pooled_events() const override { return 0; }

 private:
  void check_live(EventId event) const {
    std::lock_guard<std::mutex> lock(mutex_);
    GF_EXPECTS(live_.count(event) == 1, "wait on unknown event " + std::to_string(event));
  }

  mutable std::mutex mutex_;
  EventId next_ = 0;
  std::unordered_set<EventId> live_;
};

}  // namespace

std::shared_ptr<StreamSync> make_host_sync() { return std::make_shared<HostSync>(); }

}  // namespace gpipe_fast
