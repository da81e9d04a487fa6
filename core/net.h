// Sockets and addresses for the rendezvous: the store's listening socket (on one address, or
// on every interface only where MASTER_ADDR cannot be reached otherwise), and the address
// this host is reached by from another.
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

// Like listen_on, but the socket is only bound, not listening: it holds the port against
// every process that binds without SO_REUSEADDR and against the kernel's choice of free
// ports, while a process that binds with SO_REUSEADDR and listens (a store, c10d's or
// dtrain's) still can. A port another socket listens on fails with EADDRINUSE.
Listener reserve(const std::string& addr, int port);

// The port a listening socket is bound to.
int bound_port(int fd);

// Where rank 0's store listens for MASTER_ADDR `master_addr`: DTRAIN_STORE_BIND when set;
// else every interface ("0.0.0.0") when `master_addr` is a host name that resolves here only
// to loopback addresses (Debian's and Ubuntu's /etc/hosts map the host's own name to
// 127.0.1.1, which other nodes cannot reach); else `master_addr` itself. `why` says why
// when the answer is not `master_addr`.
std::string store_bind_address(const std::string& master_addr, std::string* why = nullptr);

// True when `addr` is "localhost" or a numeric loopback address (127.0.0.0/8, ::1).
bool is_loopback_literal(const std::string& addr);

// True when every address `host` resolves to here is a loopback address (false when it does
// not resolve).
bool resolves_to_loopback(const std::string& host);

// The local address (numeric) the kernel would send from to reach `host`: a UDP socket
// connected there, which sends nothing. Empty when `host` does not resolve or no route leads
// there.
std::string local_address_toward(const std::string& host);

}  // namespace dtrain::net
