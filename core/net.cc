#include "core/net.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

namespace dtrain::net {

namespace {

Listener bind_to(const std::string& addr, int port, bool listen) {
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
    if (::bind(fd, a->ai_addr, a->ai_addrlen) == 0 && (!listen || ::listen(fd, 1024) == 0)) {
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

}  // namespace

Listener listen_on(const std::string& addr, int port) { return bind_to(addr, port, true); }

Listener reserve(const std::string& addr, int port) { return bind_to(addr, port, false); }

int bound_port(int fd) {
  sockaddr_storage sa{};
  socklen_t len = sizeof(sa);
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&sa), &len) != 0) return -1;
  if (sa.ss_family == AF_INET) return ntohs(reinterpret_cast<sockaddr_in*>(&sa)->sin_port);
  return ntohs(reinterpret_cast<sockaddr_in6*>(&sa)->sin6_port);
}

namespace {

bool loopback(const sockaddr* sa) {
  if (sa->sa_family == AF_INET) {
    return (ntohl(reinterpret_cast<const sockaddr_in*>(sa)->sin_addr.s_addr) >> 24) == 127;
  }
  if (sa->sa_family == AF_INET6) {
    const auto* a6 = reinterpret_cast<const sockaddr_in6*>(sa);
    return IN6_IS_ADDR_LOOPBACK(&a6->sin6_addr) ||
           (IN6_IS_ADDR_V4MAPPED(&a6->sin6_addr) && a6->sin6_addr.s6_addr[12] == 127);
  }
  return false;
}

std::string numeric(const sockaddr* sa, socklen_t len) {
  char host[NI_MAXHOST];
  if (::getnameinfo(sa, len, host, sizeof(host), nullptr, 0, NI_NUMERICHOST) != 0) return {};
  return host;
}

}  // namespace

bool is_loopback_literal(const std::string& addr) {
  if (addr == "localhost") return true;
  in_addr a4{};
  if (::inet_pton(AF_INET, addr.c_str(), &a4) == 1) return (ntohl(a4.s_addr) >> 24) == 127;
  in6_addr a6{};
  return ::inet_pton(AF_INET6, addr.c_str(), &a6) == 1 && IN6_IS_ADDR_LOOPBACK(&a6);
}

bool resolves_to_loopback(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (::getaddrinfo(host.c_str(), nullptr, &hints, &found) != 0) return false;
  bool all = found != nullptr;
  for (addrinfo* a = found; a != nullptr; a = a->ai_next) all = all && loopback(a->ai_addr);
  ::freeaddrinfo(found);
  return all;
}

std::string store_bind_address(const std::string& master_addr, std::string* why) {
  if (const char* pinned = std::getenv("DTRAIN_STORE_BIND"); pinned != nullptr && *pinned) {
    if (why) *why = "DTRAIN_STORE_BIND";
    return pinned;
  }
  if (!is_loopback_literal(master_addr) && resolves_to_loopback(master_addr)) {
    if (why) {
      *why = "MASTER_ADDR '" + master_addr +
             "' resolves on this host to a loopback address only (an /etc/hosts entry such as "
             "Debian's 127.0.1.1), which other nodes cannot reach";
    }
    return "0.0.0.0";
  }
  return master_addr;
}

std::string local_address_toward(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* found = nullptr;
  if (::getaddrinfo(host.c_str(), "9", &hints, &found) != 0) return {};
  std::string out;
  for (addrinfo* a = found; a != nullptr && out.empty(); a = a->ai_next) {
    const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    sockaddr_storage local{};
    socklen_t len = sizeof(local);
    if (::connect(fd, a->ai_addr, a->ai_addrlen) == 0 &&
        ::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0) {
      out = numeric(reinterpret_cast<sockaddr*>(&local), len);
    }
    ::close(fd);
  }
  ::freeaddrinfo(found);
  return out;
}

}  // namespace dtrain::net
