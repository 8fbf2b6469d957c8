// Creating, opening, mapping and unlinking a named POSIX shared-memory file (shm_segment.hpp).
#include "gpipe_fast/shm_segment.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <thread>
#include <utility>

#include "gpipe_fast/error.hpp"

namespace gpipe_fast {
namespace {

// NAME_MAX minus room for the "sem." style prefixes some libcs add; ours never need more.
constexpr std::size_t kMaxName = 200;

void check_name(const std::string& name) {
  GF_EXPECTS(name.size() >= 2 && name.size() <= kMaxName && name[0] == '/' &&
                 name.find('/', 1) == std::string::npos,
             "a shared-memory name is '/' then 1 to " + std::to_string(kMaxName - 1) +
                 " characters without '/', got '" + name + "'");
}

std::string system_error(const std::string& what, const std::string& name, int error) {
  return "gpipe_fast: " + what + " of shared memory '" + name + "' failed: " +
         std::strerror(error);
}

// Closes a file descriptor when it goes out of scope.
struct FileDescriptor {
  int fd;
  ~FileDescriptor() {
    if (fd >= 0) ::close(fd);
  }
};

void* map(int fd, std::size_t bytes, const std::string& name) {
  void* data = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (data == MAP_FAILED) throw std::runtime_error(system_error("mmap", name, errno));
  return data;
}

}  // namespace

ShmSegment::ShmSegment(std::string name, void* data, std::size_t size, bool created)
    : name_(std::move(name)), data_(data), size_(size), named_(created) {}

ShmSegment ShmSegment::create(const std::string& name, std::size_t bytes) {
  check_name(name);
  GF_EXPECTS(bytes > 0, "a shared-memory segment needs at least one byte");
  FileDescriptor file{::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600)};
  if (file.fd < 0) {
    if (errno == EEXIST) {
      throw std::runtime_error("gpipe_fast: shared memory '" + name +
                               "' exists already: another job uses the same name, or a "
                               "crashed one left it (remove it from /dev/shm)");
    }
    throw std::runtime_error(system_error("shm_open", name, errno));
  }
  // posix_fallocate returns the error instead of setting errno.
  const int reserved = ::posix_fallocate(file.fd, 0, static_cast<off_t>(bytes));
  if (reserved != 0) {
    ::shm_unlink(name.c_str());
    throw std::runtime_error(system_error("reserving " + std::to_string(bytes) + " bytes", name,
                                          reserved) +
                             " (is /dev/shm large enough? containers often give it 64 MiB)");
  }
  void* data = nullptr;
  try {
    data = map(file.fd, bytes, name);
  } catch (...) {
    ::shm_unlink(name.c_str());
    throw;
  }
  return ShmSegment(name, data, bytes, true);
}

ShmSegment ShmSegment::open(const std::string& name, double timeout_s) {
  check_name(name);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  for (;;) {
    FileDescriptor file{::shm_open(name.c_str(), O_RDWR, 0)};
    if (file.fd < 0 && errno != ENOENT) throw std::runtime_error(system_error("shm_open", name, errno));
    if (file.fd >= 0) {
      struct stat facts {};
      if (::fstat(file.fd, &facts) != 0) throw std::runtime_error(system_error("fstat", name, errno));
      if (facts.st_size > 0) {  // sized: the creator's fallocate is done
        const auto bytes = static_cast<std::size_t>(facts.st_size);
        return ShmSegment(name, map(file.fd, bytes, name), bytes, false);
      }
    }
    if (std::chrono::steady_clock::now() >= deadline) {
      throw WaitTimeout("gpipe_fast: shared memory '" + name + "' did not appear within " +
                        std::to_string(timeout_s) +
                        " s (is its creator on this host, with the same /dev/shm?)");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

ShmSegment::ShmSegment(ShmSegment&& other) noexcept
    : name_(std::move(other.name_)),
      data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      named_(std::exchange(other.named_, false)) {}

ShmSegment& ShmSegment::operator=(ShmSegment&& other) noexcept {
  if (this != &other) {
    release();
    name_ = std::move(other.name_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    named_ = std::exchange(other.named_, false);
  }
  return *this;
}

ShmSegment::~ShmSegment() { release(); }

void ShmSegment::unlink() {
  // ENOENT: the other side removed it first, which is the point.
  if (::shm_unlink(name_.c_str()) != 0 && errno != ENOENT) {
    throw std::runtime_error(system_error("shm_unlink", name_, errno));
  }
  named_ = false;
}

void ShmSegment::release() noexcept {
  if (named_) ::shm_unlink(name_.c_str());
  named_ = false;
  if (data_ != nullptr) ::munmap(data_, size_);
  data_ = nullptr;
  size_ = 0;
}

}  // namespace gpipe_fast
