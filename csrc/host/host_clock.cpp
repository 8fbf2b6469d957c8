// Host task clock: the steady clock read on the worker thread, known at once.
#include "gpipe_fast/error.hpp"
#include "gpipe_fast/task_clock.hpp"

namespace gpipe_fast {
namespace {

class HostClock final : public TaskClock {
 public:
  std::string name(const Stream&) const override { return "host"; }
  void calibrate(const std::vector<Stream>&) override {}
  Stamp stamp(const Stream&) override { return Stamp{steady_now_ns(), -1}; }
  std::int64_t resolve(const Stamp& stamp) override {
    GF_EXPECTS(stamp.event < 0, "the host clock has no timing events");
    return stamp.ns;
  }
  void discard(const Stamp&) noexcept override {}
  std::int64_t live_events() const override { return 0; }
  std::int64_t pooled_events() const override { return 0; }
};

}  // namespace

std::shared_ptr<TaskClock> make_host_clock() { return std::make_shared<HostClock>(); }

}  // namespace gpipe_fast
