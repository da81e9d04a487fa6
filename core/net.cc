#include "core/net.h"

#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace dtrain::net {

Listener listen_on(const std::string& addr, int port) {
  Listener out;
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const std::string service = std::to_string(port);
  int rc = ::getaddrinfo(addr.c_str(), service.c_str(), &hints, &found);
  if (rc != 0) {
    out.error = EADDRNOTAVAIL;
    out.detail = std::string("does not resolve: ") + ::gai_strerror(rc);
    return out;
  }
  for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
    int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) {
      out.error = errno;
      continue;
    }
    int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(fd, a->ai_addr, a->ai_addrlen) == 0 && ::listen(fd, 1024) == 0) {
      out.fd = fd;
      out.error = 0;
      break;
    }
    out.error = errno;
    ::close(fd);
  }
  ::freeaddrinfo(found);
  if (out.fd < 0) out.detail = std::strerror(out.error);
  return out;
}

int bound_port(int fd) {
  sockaddr_storage sa{};
  socklen_t len = sizeof(sa);
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&sa), &len) != 0) return -1;
  if (sa.ss_family == AF_INET) return ntohs(reinterpret_cast<sockaddr_in*>(&sa)->sin_port);
  return ntohs(reinterpret_cast<sockaddr_in6*>(&sa)->sin6_port);
}

}  // namespace dtrain::net
