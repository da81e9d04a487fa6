#include "framework/checkpoint/atomic_file.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <optional>

#include "core/error.h"
#include "core/faults.h"

namespace dtrain::framework::ckpt {
namespace {

std::string errno_text(int e) {
  std::string why = std::strerror(e);
  if (e == ENOSPC || e == EFBIG || e == EDQUOT) {
    why += " (the disk is full, or a file-size limit was reached)";
  }
  return why;
}

void write_all(int fd, const char* data, size_t n, const std::string& path) {
  while (n > 0) {
    ssize_t w = ::write(fd, data, n);
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) {
      const int e = errno;
      DTRAIN_FAIL(CheckpointError, "checkpoint: writing '", path, "' failed: ", errno_text(e));
    }
    data += w;
    n -= static_cast<size_t>(w);
  }
}

// A pickle of `value` that Python's restricted unpickler accepts: no type tags, and no

}  // namespace

void sync_dir(const std::string& dir) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return;  // nothing to make durable
  ::fsync(fd);
  ::close(fd);
}

PendingFile::PendingFile(std::string dir, std::string name)
    : dir_(std::move(dir)),
      name_(std::move(name)),
      path_(dir_ + "/" + name_),
      tmp_(path_ + ".tmp." + std::to_string(::getpid())) {
  fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0) {
    const int e = errno;
    DTRAIN_FAIL(CheckpointError, "checkpoint: cannot create '", tmp_, "': ", errno_text(e));
  }
}

PendingFile::~PendingFile() {
  if (fd_ >= 0) {  // an exception: leave nothing behind
    ::close(fd_);
    ::unlink(tmp_.c_str());
  }
}

void PendingFile::append(const char* data, size_t n) {
  hash_.update(data, n);
  write_all(fd_, data, n, tmp_);
  bytes_ += n;
#ifdef __linux__
  // Start writeback every 16 MiB, so the fsync at the end waits for little.
  constexpr uint64_t kChunk = uint64_t{16} << 20;
  if (bytes_ - flushed_ >= kChunk) {
    ::sync_file_range(fd_, static_cast<off_t>(flushed_), static_cast<off_t>(bytes_ - flushed_),
                      SYNC_FILE_RANGE_WRITE);
    flushed_ = bytes_;
  }
#endif
}

FileInfo PendingFile::commit() {
  if (::fsync(fd_) != 0 || ::close(fd_) != 0) {
    const int e = errno;
    fd_ = -1;
    ::unlink(tmp_.c_str());
    DTRAIN_FAIL(CheckpointError, "checkpoint: syncing '", tmp_, "' failed: ", errno_text(e));
  }
  fd_ = -1;
  if (std::optional<std::string> crash = faults::text("CRASH_BEFORE_RENAME")) {
    const std::string last = dir_.substr(dir_.find_last_of('/') + 1) + "/" + name_;
    if (name_ == *crash || last == *crash) ::raise(SIGKILL);
  }
  if (::rename(tmp_.c_str(), path_.c_str()) != 0) {
    const int e = errno;
    ::unlink(tmp_.c_str());
    DTRAIN_FAIL(CheckpointError, "checkpoint: renaming '", tmp_, "' to '", path_,
                "' failed: ", errno_text(e));
  }
  sync_dir(dir_);
  return {name_, bytes_, hash_.digest()};
}

FileInfo write_file(const std::string& dir, const std::string& name,
                    const std::vector<char>& bytes) {
  PendingFile f(dir, name);
  f.append(bytes.data(), bytes.size());
  return f.commit();
}

std::vector<char> read_raw(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    const int e = errno;
    DTRAIN_FAIL(CheckpointError, "checkpoint: cannot read '", path, "': ", std::strerror(e));
  }
  struct stat st {};
  ::fstat(fd, &st);
  std::vector<char> bytes(static_cast<size_t>(st.st_size));
  size_t done = 0;
  while (done < bytes.size()) {
    ssize_t r = ::read(fd, bytes.data() + done, bytes.size() - done);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) break;  // a file that shrank: the size check reports it
    done += static_cast<size_t>(r);
  }
  ::close(fd);
  bytes.resize(done);
  return bytes;
}

std::vector<char> read_file(const std::string& dir, const FileInfo& expected) {
  const std::string path = dir + "/" + expected.name;
  std::vector<char> bytes = read_raw(path);
  DTRAIN_CHECK_AS(CheckpointError, bytes.size() == expected.bytes, "checkpoint: '", path, "' has ",
                  bytes.size(), " bytes but was written with ", expected.bytes,
                  " (truncated or replaced); this checkpoint cannot be trusted");
  const uint64_t sum = checksum(bytes.data(), bytes.size());
  DTRAIN_CHECK_AS(CheckpointError, sum == expected.checksum, "checkpoint: '", path,
                  "' fails its checksum (xxh64 ", hex(sum), ", written as ", hex(expected.checksum),
                  "): the file is corrupt; this checkpoint cannot be trusted");
  return bytes;
}

}  // namespace dtrain::framework::ckpt
