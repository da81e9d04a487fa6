// A TCP socket listening on one address (never on every interface), for the rendezvous store
// and for dtrain-launch's port checks.
#pragma once

#include <string>

namespace dtrain::net {

struct Listener {
  int fd = -1;         // >= 0 on success (close-on-exec); the caller owns it
  int error = 0;       // errno of the last failed step: EADDRINUSE, EADDRNOTAVAIL, ...
  std::string detail;  // what failed, for messages ("does not resolve: ...")
};

// Resolves `addr` (a name or a numeric IPv4/IPv6 address) and listens on the first of its
// addresses that binds, at `port` (0: a free port the kernel picks).
Listener listen_on(const std::string& addr, int port);

// The port a listening socket is bound to.
int bound_port(int fd);

}  // namespace dtrain::net
