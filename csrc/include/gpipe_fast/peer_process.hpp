// Whether the process at the other end of a shared-memory channel is still running.
#pragma once

#include <sys/types.h>

namespace gpipe_fast {

// Why: a process killed with SIGKILL cannot close its channels, and a futex wait is not woken
// by its death, so a waiter asks between slices. A pidfd (Linux 5.3+) turns readable when the
// process exits, zombie or not, and cannot name a later process that reuses the pid; without
// one, kill(pid, 0) and /proc/<pid>/stat stand in.
class PeerProcess {
 public:
  explicit PeerProcess(pid_t pid);
  PeerProcess(const PeerProcess&) = delete;
  PeerProcess& operator=(const PeerProcess&) = delete;
  ~PeerProcess();

  pid_t pid() const { return pid_; }
  // False once the process has exited; true while it runs or when it cannot be watched (a
  // pid of another pid namespace: the caller's own timeout still bounds its wait).
  bool alive() const;

 private:
  pid_t pid_;
  int pidfd_ = -1;
  bool watchable_ = true;
};

}  // namespace gpipe_fast
