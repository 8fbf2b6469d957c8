// The boundary copier's policy with fake device calls: event ordering, peer access, errors.
#include <memory>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "check.hpp"
#include "gpipe_fast/copy.hpp"
#include "gpipe_fast/device.hpp"
#include "gpipe_fast/error.hpp"

using gpipe_fast::BoundaryCopier;
using gpipe_fast::DeviceBuffer;
using gpipe_fast::EventId;
using gpipe_fast::InvalidArgument;
using gpipe_fast::Stream;

namespace {

using Log = std::shared_ptr<std::vector<std::string>>;

std::string name(const Stream& stream) { return "s" + std::to_string(stream.handle); }

// A StreamSync that logs every call and tracks live events like the real pools.
class LoggingSync final : public gpipe_fast::StreamSync {
 public:
  explicit LoggingSync(Log log) : log_(std::move(log)) {}
  std::string name() const override { return "logging"; }
  EventId record(const Stream& stream) override {
    live_.insert(next_);
    log_->push_back("record " + ::name(stream) + " e" + std::to_string(next_));
    return next_++;
  }
  void wait(const Stream& stream, EventId event) override {
    if (!live_.count(event)) throw std::logic_error("wait on a released event");
    log_->push_back("wait " + ::name(stream) + " e" + std::to_string(event));
  }
  void synchronize(EventId) override { log_->push_back("synchronize"); }
  void release(EventId event) override {
    live_.erase(event);
    log_->push_back("release e" + std::to_string(event));
  }
  std::int64_t live_events() const override { return static_cast<std::int64_t>(live_.size()); }
  std::int64_t pooled_events() const override { return next_; }

 private:
  Log log_;
  EventId next_ = 0;
  std::set<EventId> live_;
};

// Device calls as a log; pairs in `peers` can access each other; copies may be made to fail.
class FakeOps final : public gpipe_fast::CopyOps {
 public:
  FakeOps(Log log, std::set<std::pair<int, int>> peers) : log_(std::move(log)), peers_(peers) {}
  bool can_access_peer(int device, int peer) override {
    log_->push_back("can " + std::to_string(device) + "->" + std::to_string(peer));
    return peers_.count({device, peer}) > 0;
  }
  void enable_peer_access(int device, int peer) override {
    log_->push_back("enable " + std::to_string(device) + "->" + std::to_string(peer));
  }
  void copy_async(const DeviceBuffer& destination, const DeviceBuffer& source, std::size_t bytes,
                  const Stream& stream) override {
    if (fail) throw gpipe_fast::CudaError("copy failed on purpose");
    log_->push_back("copy " + std::to_string(bytes) + " " + std::to_string(source.device) +
                    "->" + std::to_string(destination.device) + " on " + ::name(stream));
  }
  bool fail = false;

 private:
  Log log_;
  std::set<std::pair<int, int>> peers_;
};

struct Fixture {
  Log log = std::make_shared<std::vector<std::string>>();
  std::shared_ptr<LoggingSync> sync = std::make_shared<LoggingSync>(log);
  std::shared_ptr<FakeOps> ops = std::make_shared<FakeOps>(log, std::set<std::pair<int, int>>{{0, 1}});
  BoundaryCopier copier{sync, ops};
};

const Stream kConsumer{1, 7};
const Stream kCopy{1, 9};

}  // namespace

TEST(copy_waits_for_the_consumer_then_the_consumer_waits_for_the_copy) {
  Fixture f;
  f.copier.copy(DeviceBuffer{0x2000, 1}, DeviceBuffer{0x1000, 0}, 4096, kConsumer, kCopy);
  const std::vector<std::string> want = {
      "record s7 e0", "wait s9 e0", "release e0", "copy 4096 0->1 on s9",
      "record s9 e1", "wait s7 e1", "release e1",
  };
  CHECK_EQ(*f.log, want);
  CHECK_EQ(f.sync->live_events(), 0);
}

TEST(copy_of_zero_bytes_does_nothing) {
  Fixture f;
  f.copier.copy(DeviceBuffer{0x2000, 1}, DeviceBuffer{0x1000, 1}, 0, kConsumer, kCopy);
  CHECK(f.log->empty());
}

TEST(copy_rejects_host_buffers_and_a_stream_on_a_third_device) {
  Fixture f;
  CHECK_THROWS(f.copier.copy(DeviceBuffer{0x2000, 1}, DeviceBuffer{0x1000, -1}, 8, kConsumer,
                             kCopy),
               InvalidArgument);
  CHECK_THROWS(f.copier.copy(DeviceBuffer{0x2000, 1}, DeviceBuffer{0x1000, 0}, 8, kConsumer,
                             Stream{2, 9}),
               InvalidArgument);
  CHECK(f.log->empty());
}

TEST(a_failed_copy_releases_its_event_and_propagates) {
  Fixture f;
  f.ops->fail = true;
  CHECK_THROWS(f.copier.copy(DeviceBuffer{0x2000, 1}, DeviceBuffer{0x1000, 1}, 8, kConsumer,
                             kCopy),
               gpipe_fast::CudaError);
  CHECK_EQ(f.sync->live_events(), 0);
}

TEST(peer_access_is_asked_once_per_ordered_pair) {
  Fixture f;
  CHECK(f.copier.enable_peer_access(0, 1));
  CHECK(f.copier.enable_peer_access(0, 1));
  CHECK(!f.copier.enable_peer_access(1, 0));  // only 0 -> 1 has a peer path here
  CHECK(!f.copier.enable_peer_access(1, 0));
  CHECK(f.copier.enable_peer_access(3, 3));  // a device with itself: no driver call
  const std::vector<std::string> want = {"can 0->1", "enable 0->1", "can 1->0"};
  CHECK_EQ(*f.log, want);
  CHECK_THROWS(f.copier.enable_peer_access(-1, 0), InvalidArgument);
}
