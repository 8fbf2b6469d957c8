// Watching another process's exit through a pidfd, or its pid where pidfds are missing.
#include "gpipe_fast/peer_process.hpp"

#include <poll.h>
#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <fstream>
#include <string>

namespace gpipe_fast {
namespace {

// The state letter of /proc/<pid>/stat ("pid (comm) S ..."), or '?' when it cannot be read.
char process_state(pid_t pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(stat, line)) return '?';
  const auto end_of_name = line.rfind(')');  // the command name may hold spaces and ')'
  if (end_of_name == std::string::npos || end_of_name + 2 >= line.size()) return '?';
  return line[end_of_name + 2];
}

}  // namespace

PeerProcess::PeerProcess(pid_t pid) : pid_(pid) {
#ifdef SYS_pidfd_open
  pidfd_ = static_cast<int>(::syscall(SYS_pidfd_open, pid, 0));
  // ESRCH while the peer just told us its pid: another pid namespace, so unwatchable.
  if (pidfd_ < 0 && errno == ESRCH) watchable_ = false;
#endif
}

PeerProcess::~PeerProcess() {
  if (pidfd_ >= 0) ::close(pidfd_);
}

bool PeerProcess::alive() const {
  if (!watchable_) return true;
  if (pidfd_ >= 0) {
    pollfd exited{pidfd_, POLLIN, 0};
    return ::poll(&exited, 1, 0) == 0;
  }
  if (::kill(pid_, 0) != 0 && errno == ESRCH) return false;
  const char state = process_state(pid_);
  return state != 'Z' && state != 'X';
}

}  // namespace gpipe_fast
