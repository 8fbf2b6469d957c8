// A named POSIX shared-memory file mapped into this process, unlinked as soon as it may be.
#pragma once

#include <cstddef>
#include <string>

namespace gpipe_fast {

// Why a name at all: two processes that do not share a parent find the same memory through
// it. Why unlink early: /dev/shm outlives a killed job, so the name is removed as soon as both
// sides hold a mapping (the memory lives until the last mapping goes).
class ShmSegment {
 public:
  // Creates `name` ("/..." with no other '/'), failing when it exists (another job, or a
  // stale file: names must be unique per job). The memory is reserved now (posix_fallocate),
  // so a full /dev/shm fails here with advice instead of SIGBUS at a later write.
  static ShmSegment create(const std::string& name, std::size_t bytes);
  // Opens `name` once its creator has sized it, waiting up to `timeout_s` for that; throws
  // WaitTimeout when it does not appear (the peer is on another host, or has another /dev/shm).
  static ShmSegment open(const std::string& name, double timeout_s);

  ShmSegment(ShmSegment&& other) noexcept;
  ShmSegment& operator=(ShmSegment&& other) noexcept;
  ShmSegment(const ShmSegment&) = delete;
  ShmSegment& operator=(const ShmSegment&) = delete;
  ~ShmSegment();  // unmaps; removes the name when this side created it and it is still there

  // Removes the name (once; a name already removed by the other side is fine). The mapping
  // stays valid.
  void unlink();

  void* data() const { return data_; }
  std::size_t size() const { return size_; }
  const std::string& name() const { return name_; }

 private:
  ShmSegment(std::string name, void* data, std::size_t size, bool created);
  void release() noexcept;

  std::string name_;
  void* data_ = nullptr;
  std::size_t size_ = 0;
  bool named_ = false;  // this side created the name and has not removed it yet
};

}  // namespace gpipe_fast
