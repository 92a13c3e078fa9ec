#include "moecore/comm/tcp_rendezvous.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <set>
#include <string_view>
#include <thread>

#include "moecore/core/error.h"

extern char** environ;

namespace moecore::comm {
namespace {

constexpr uint32_t kMagic = 0x5652434D;  // "MCRV" read as little-endian bytes
constexpr uint32_t kVersion = 2;
constexpr uint64_t kMaxPayload = 1 << 20;
constexpr size_t kHelloBytes = 20, kHeaderBytes = 16;
// Rank 0 waits this long for a connection's hello before dropping it as a stranger's; a peer
// scanning several candidates waits a little longer for rank 0's header before moving on.
constexpr int kHelloSeconds = 10, kScanReplySeconds = 15;

using Clock = std::chrono::steady_clock;

// Closes the descriptor when it goes out of scope.
struct Fd {
  int fd = -1;
  explicit Fd(int f = -1) : fd(f) {}
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

std::string errno_text(int e) { return std::strerror(e); }

void put_u32(uint8_t* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
void put_u64(uint8_t* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
uint32_t get_u32(const uint8_t* p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= static_cast<uint32_t>(p[i]) << (8 * i);
  return v;
}
uint64_t get_u64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= static_cast<uint64_t>(p[i]) << (8 * i);
  return v;
}

int ms_until(Clock::time_point deadline) {
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return static_cast<int>(std::clamp<int64_t>(ms, 0, 1 << 30));
}

enum class Io { Ok, Eof, Timeout, Failed };

// Reads n bytes before `deadline`; *got says how many arrived.
Io read_full(int fd, uint8_t* buf, size_t n, Clock::time_point deadline, size_t* got, int* err) {
  *got = 0;
  while (*got < n) {
    pollfd p{fd, POLLIN, 0};
    const int r = ::poll(&p, 1, ms_until(deadline));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return *err = errno, Io::Failed;
    if (r == 0) return Io::Timeout;
    const ssize_t k = ::recv(fd, buf + *got, n - *got, 0);
    if (k < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (k < 0) return *err = errno, Io::Failed;
    if (k == 0) return Io::Eof;
    *got += static_cast<size_t>(k);
  }
  return Io::Ok;
}

// Blocking send of everything; MSG_NOSIGNAL: a peer that went away is an error, not SIGPIPE.
bool send_all(int fd, const uint8_t* buf, size_t n, int* err) {
  while (n > 0) {
    const ssize_t k = ::send(fd, buf, n, MSG_NOSIGNAL);
    if (k < 0 && errno == EINTR) continue;
    if (k < 0) return *err = errno, false;
    buf += k;
    n -= static_cast<size_t>(k);
  }
  return true;
}

struct Who {
  std::string addr;
  int port, rank, world;
  double timeout_s;
  int ports;  // candidates [port, port + ports)
  uint32_t key;
  std::string prefix() const {
    return detail::concat("tcp rendezvous (rank ", rank, " of ", world, "): ");
  }
  std::string port_text() const {
    return ports == 1 ? detail::concat("port ", port) : detail::concat("ports ", port, "..", port + ports - 1);
  }
  std::string where() const { return detail::concat("MASTER_ADDR=", addr, " ", port_text()); }
  std::string where(int p) const { return detail::concat("MASTER_ADDR=", addr, " port ", p); }
};

// ---- rank 0 ------------------------------------------------------------------------

// A socket bound to `port` on every interface: IPv6 accepting IPv4 too, else IPv4 only (hosts
// without IPv6). -1 with *err set when binding fails.
int bind_any(int family, int port, int* err) {
  Fd fd(::socket(family, SOCK_STREAM, 0));
  if (fd.fd < 0) return *err = errno, -1;
  const int one = 1, zero = 0;
  ::setsockopt(fd.fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  int rc;
  if (family == AF_INET6) {
    ::setsockopt(fd.fd, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof zero);
    sockaddr_in6 a{};
    a.sin6_family = AF_INET6;
    a.sin6_addr = in6addr_any;
    a.sin6_port = htons(static_cast<uint16_t>(port));
    rc = ::bind(fd.fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  } else {
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_ANY);
    a.sin_port = htons(static_cast<uint16_t>(port));
    rc = ::bind(fd.fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  }
  if (rc != 0) return *err = errno, -1;
  const int out = fd.fd;
  fd.fd = -1;
  return out;
}

// Listens on the first candidate port that can be bound; *bound says which.
int listen_socket(const Who& w, int* bound) {
  int err = 0, fd = -1;
  for (int i = 0; i < w.ports && fd < 0; ++i) {
    *bound = w.port + i;
    fd = bind_any(AF_INET6, *bound, &err);
    if (fd < 0 && err != EADDRINUSE) fd = bind_any(AF_INET, *bound, &err);
  }
  MC_CHECK(fd >= 0, w.prefix(), "cannot listen on ", w.ports == 1 ? "" : "any of ", w.port_text(), " (",
           errno_text(err), "), expected a free port on this host (", w.where(),
           "); set MOECORE_RENDEZVOUS_PORT to a free port (the same on every rank)");
  Fd guard(fd);
  MC_CHECK(::listen(fd, std::max(16, w.world)) == 0, w.prefix(), "listen on port ", *bound, " failed: ",
           errno_text(errno));
  guard.fd = -1;
  return fd;
}

std::vector<uint8_t> serve(const Who& w, const std::vector<uint8_t>& payload) {
  MC_CHECK(payload.size() <= kMaxPayload, w.prefix(), "payload of ", payload.size(), " bytes, expected at most ",
           kMaxPayload);
  int port = w.port;
  Fd listener(listen_socket(w, &port));
  const Clock::time_point deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                                        std::chrono::duration<double>(w.timeout_s));
  std::vector<uint8_t> reply(kHeaderBytes + payload.size());
  put_u32(reply.data(), kMagic);
  put_u32(reply.data() + 4, static_cast<uint32_t>(w.world));
  put_u64(reply.data() + 8, payload.size());
  std::copy(payload.begin(), payload.end(), reply.begin() + kHeaderBytes);

  std::set<int> served;
  while (static_cast<int>(served.size()) < w.world - 1) {
    pollfd p{listener.fd, POLLIN, 0};
    const int r = ::poll(&p, 1, ms_until(deadline));
    if (r < 0 && errno == EINTR) continue;
    MC_CHECK(r >= 0, w.prefix(), "poll failed: ", errno_text(errno));
    if (r == 0) {
      std::string missing;
      for (int k = 1; k < w.world; ++k)
        if (!served.count(k)) missing += (missing.empty() ? "" : ", ") + std::to_string(k);
      MC_FAIL(w.prefix(), "timeout after ", w.timeout_s, " s waiting on port ", port, " for rank(s) ", missing, " (",
              served.size(), " of ", w.world - 1, " connected), expected every rank to start and reach ", w.where(port),
              " (MOECORE_RENDEZVOUS_TIMEOUT sets the limit)");
    }
    Fd conn(::accept(listener.fd, nullptr, nullptr));
    if (conn.fd < 0) continue;  // the peer gave up between poll and accept
    uint8_t hello[kHelloBytes];
    size_t got = 0;
    int err = 0;
    // A peer sends its hello right after connecting; anything slower is not one of ours.
    const Clock::time_point hello_deadline = std::min(deadline, Clock::now() + std::chrono::seconds(kHelloSeconds));
    if (read_full(conn.fd, hello, kHelloBytes, hello_deadline, &got, &err) != Io::Ok) continue;
    if (get_u32(hello) != kMagic || get_u32(hello + 4) != kVersion) continue;  // not a moecore rank
    if (get_u32(hello + 16) != w.key) continue;  // another job's rank: closed, so it tries its next port
    const int peer_world = static_cast<int>(get_u32(hello + 8)), peer_rank = static_cast<int>(get_u32(hello + 12));
    if (peer_world != w.world) {
      send_all(conn.fd, reply.data(), kHeaderBytes, &err);  // the peer reports the mismatch too
      MC_FAIL(w.prefix(), "WORLD_SIZE mismatch: rank ", peer_rank, " has WORLD_SIZE=", peer_world,
              ", rank 0 has WORLD_SIZE=", w.world, "; expected every rank of one job to have the same WORLD_SIZE (is ",
              "another job using ", w.where(port), "?)");
    }
    MC_CHECK(peer_rank >= 1 && peer_rank < w.world, w.prefix(), "a peer claims RANK=", peer_rank,
             ", expected 1 <= RANK < WORLD_SIZE=", w.world);
    MC_CHECK(!served.count(peer_rank), w.prefix(), "two processes claim RANK=", peer_rank,
             ", expected one process per rank (is another job using ", w.where(port), "?)");
    MC_CHECK(send_all(conn.fd, reply.data(), reply.size(), &err), w.prefix(), "sending the payload to rank ", peer_rank,
             " failed: ", errno_text(err));
    served.insert(peer_rank);
  }
  return payload;
}

// ---- ranks 1.. ----------------------------------------------------------------------

// One non-blocking connect to `ai`, bounded by `deadline`; the connected socket or -1 (*err set).
int try_connect(const addrinfo* ai, Clock::time_point deadline, int* err) {
  Fd fd(::socket(ai->ai_family, ai->ai_socktype, ai->ai_protocol));
  if (fd.fd < 0) return *err = errno, -1;
  const int flags = ::fcntl(fd.fd, F_GETFL, 0);
  ::fcntl(fd.fd, F_SETFL, flags | O_NONBLOCK);
  if (::connect(fd.fd, ai->ai_addr, ai->ai_addrlen) != 0) {
    if (errno != EINPROGRESS) return *err = errno, -1;
    pollfd p{fd.fd, POLLOUT, 0};
    int r;
    do r = ::poll(&p, 1, std::min(ms_until(deadline), 5000));
    while (r < 0 && errno == EINTR);
    if (r <= 0) return *err = (r == 0 ? ETIMEDOUT : errno), -1;
    int so = 0;
    socklen_t len = sizeof so;
    ::getsockopt(fd.fd, SOL_SOCKET, SO_ERROR, &so, &len);
    if (so != 0) return *err = so, -1;
  }
  ::fcntl(fd.fd, F_SETFL, flags);
  const int out = fd.fd;
  fd.fd = -1;
  return out;
}

// One connection to rank 0's candidate `port` (each address `addr` resolves to); the socket, or
// -1 with *why set.
int connect_once(const Who& w, int port, Clock::time_point deadline, std::string* why) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* list = nullptr;
  const int g = ::getaddrinfo(w.addr.c_str(), std::to_string(port).c_str(), &hints, &list);
  if (g != 0) {
    *why = detail::concat("cannot resolve MASTER_ADDR=", w.addr, ": ", ::gai_strerror(g));
    return -1;
  }
  int fd = -1;
  for (const addrinfo* ai = list; ai && fd < 0; ai = ai->ai_next) {
    int err = 0;
    fd = try_connect(ai, deadline, &err);
    if (fd < 0) *why = err == ECONNREFUSED ? std::string("connection refused") : errno_text(err);
  }
  ::freeaddrinfo(list);
  return fd;
}

// Hello, header and payload over a connection to candidate `port`. With one candidate every
// failure is an Error; with several, an answer that is not moecore's rank 0 (closed, silent,
// another header) returns nothing with *why set, so the caller tries the next candidate. A
// WORLD_SIZE mismatch from moecore's rank 0 with this job's key is an Error either way.
std::optional<std::vector<uint8_t>> exchange(const Who& w, int fd, int port, Clock::time_point deadline,
                                             std::string* why) {
  const bool scan = w.ports > 1;
  uint8_t hello[kHelloBytes];
  put_u32(hello, kMagic);
  put_u32(hello + 4, kVersion);
  put_u32(hello + 8, static_cast<uint32_t>(w.world));
  put_u32(hello + 12, static_cast<uint32_t>(w.rank));
  put_u32(hello + 16, w.key);
  int err = 0;
  if (!send_all(fd, hello, sizeof hello, &err)) {
    MC_CHECK(scan, w.prefix(), "sending to rank 0 at ", w.where(port), " failed: ", errno_text(err));
    *why = detail::concat("sending the hello failed: ", errno_text(err));
    return std::nullopt;
  }
  auto read_or_fail = [&](uint8_t* buf, size_t n, const char* what, Clock::time_point until) {
    size_t got = 0;
    const Io io = read_full(fd, buf, n, until, &got, &err);
    if (io == Io::Ok) return true;
    if (scan) {
      *why = io == Io::Timeout ? detail::concat("no answer to the hello within ", kScanReplySeconds, " s")
             : io == Io::Eof  ? detail::concat("closed after ", got, " of ", n, " bytes of the ", what)
                              : errno_text(err);
      return false;
    }
    MC_CHECK(io != Io::Timeout, w.prefix(), "timeout after ", w.timeout_s, " s waiting for the ", what, " from ",
             w.where(port), " (", got, " of ", n, " bytes arrived), expected rank 0 to answer");
    MC_CHECK(io != Io::Eof, w.prefix(), "short read: ", w.where(port), " closed the connection after ", got, " of ", n,
             " bytes of the ", what, ", expected moecore's rank 0 (is another service listening there?)");
    MC_FAIL(w.prefix(), "reading the ", what, " from ", w.where(port), " failed: ", errno_text(err));
  };
  uint8_t header[kHeaderBytes];
  const Clock::time_point reply_deadline =
      scan ? std::min(deadline, Clock::now() + std::chrono::seconds(kScanReplySeconds)) : deadline;
  if (!read_or_fail(header, kHeaderBytes, "header", reply_deadline)) return std::nullopt;
  const uint32_t magic = get_u32(header);
  const uint64_t length = get_u64(header + 8);
  if (magic != kMagic && scan) {
    *why = "a listener that is not moecore's rank 0";
    return std::nullopt;
  }
  MC_CHECK(magic == kMagic, w.prefix(), "bad header from ", w.where(port), ": magic 0x", std::hex, magic,
           ", expected 0x", kMagic, std::dec, " (moecore's rendezvous); another service listens on that port");
  const int root_world = static_cast<int>(get_u32(header + 4));
  MC_CHECK(root_world == w.world, w.prefix(), "WORLD_SIZE mismatch: rank 0 at ", w.where(port), " has WORLD_SIZE=",
           root_world, ", this rank has WORLD_SIZE=", w.world, "; expected every rank of one job to have the same ",
           "WORLD_SIZE");
  MC_CHECK(length <= kMaxPayload, w.prefix(), "bad header from ", w.where(port), ": payload length ", length,
           ", expected at most ", kMaxPayload);
  std::vector<uint8_t> payload(length);
  if (length > 0 && !read_or_fail(payload.data(), payload.size(), "payload", deadline))
    MC_FAIL(w.prefix(), "reading the payload from ", w.where(port), " failed: ", *why);
  return payload;
}

// Tries the candidates in order, round after round every 100 ms (rank 0 may start later).
std::vector<uint8_t> receive(const Who& w) {
  const Clock::time_point deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                                        std::chrono::duration<double>(w.timeout_s));
  std::string last = "no attempt";
  int last_port = w.port;
  while (true) {
    for (int i = 0; i < w.ports; ++i) {
      const int port = w.port + i;
      std::string why;
      Fd conn(connect_once(w, port, deadline, &why));
      if (conn.fd >= 0) {
        if (std::optional<std::vector<uint8_t>> payload = exchange(w, conn.fd, port, deadline, &why)) return *payload;
      }
      last = why;
      last_port = port;
    }
    if (Clock::now() >= deadline) break;
    std::this_thread::sleep_for(std::min<Clock::duration>(std::chrono::milliseconds(100), deadline - Clock::now()));
  }
  MC_FAIL(w.prefix(), "timeout after ", w.timeout_s, " s connecting to rank 0 at ", w.where(), " (last error",
          w.ports == 1 ? std::string() : detail::concat(", port ", last_port), ": ", last,
          "), expected rank 0 to listen there: is rank 0 running and MASTER_ADDR reachable from this host? ",
          "(MOECORE_RENDEZVOUS_TIMEOUT sets the limit)");
}

int parse_port(const std::string& name, const std::string& text) {
  char* end = nullptr;
  errno = 0;
  const long v = std::strtol(text.c_str(), &end, 10);
  MC_CHECK(!text.empty() && errno == 0 && *end == '\0' && v >= 1 && v <= 65535, name, "='", text,
           "', expected a port in 1..65535");
  return static_cast<int>(v);
}

}  // namespace

std::vector<uint8_t> tcp_broadcast(const std::string& addr, int port, int rank, int world,
                                   const std::vector<uint8_t>& payload_on_rank0, double timeout_s, int ports,
                                   uint32_t job_key) {
  const Who w{addr, port, rank, world, timeout_s, ports, job_key};
  MC_CHECK(world >= 1 && rank >= 0 && rank < world, w.prefix(), "expected 0 <= rank < world");
  MC_CHECK(ports >= 1 && port >= 1 && port + ports - 1 <= 65535, w.prefix(), "ports ", port, "..", port + ports - 1,
           ", expected ports in 1..65535");
  MC_CHECK(timeout_s > 0, w.prefix(), "timeout ", timeout_s, " s, expected > 0");
  if (world == 1) return payload_on_rank0;
  return rank == 0 ? serve(w, payload_on_rank0) : receive(w);
}

RendezvousEndpoint rendezvous_endpoint(const LaunchEnv& env, const std::map<std::string, std::string>& vars) {
  MC_CHECK(!env.master_addr.empty() && env.master_port >= 1, "tcp rendezvous: MASTER_ADDR/MASTER_PORT are not set (",
           "launcher ", env.launcher, "), expected a torchrun environment");
  RendezvousEndpoint ep;
  ep.addr = env.master_addr;
  auto get = [&](const char* k) -> const std::string* {
    auto it = vars.find(k);
    return it == vars.end() ? nullptr : &it->second;
  };
  if (const std::string* p = get("MOECORE_RENDEZVOUS_PORT")) {
    ep.port = parse_port("MOECORE_RENDEZVOUS_PORT", *p);
    ep.port_rule = "MOECORE_RENDEZVOUS_PORT";
  } else if (const std::string* s = get("TORCHELASTIC_USE_AGENT_STORE"); s && *s == "True") {
    constexpr int kCandidates = 8;
    const bool below = env.master_port + kCandidates > 65535;
    ep.port = below ? env.master_port - kCandidates : env.master_port + 1;
    ep.ports = kCandidates;
    ep.port_rule = detail::concat(below ? "MASTER_PORT-8..-1" : "MASTER_PORT+1..+8",
                                  ", the first free (torchrun's agent holds MASTER_PORT=", env.master_port,
                                  ": TORCHELASTIC_USE_AGENT_STORE=True)");
  } else {
    ep.port = env.master_port;
    ep.port_rule = "MASTER_PORT";
  }
  ep.job_key = static_cast<uint32_t>(env.master_port);
  if (const std::string* t = get("MOECORE_RENDEZVOUS_TIMEOUT")) {
    char* end = nullptr;
    ep.timeout_s = std::strtod(t->c_str(), &end);
    MC_CHECK(!t->empty() && *end == '\0' && ep.timeout_s > 0, "MOECORE_RENDEZVOUS_TIMEOUT='", *t,
             "', expected a number of seconds > 0");
  }
  return ep;
}

RendezvousEndpoint rendezvous_endpoint(const LaunchEnv& env) {
  std::map<std::string, std::string> vars;
  for (char** e = environ; e && *e; ++e) {
    const std::string_view kv(*e);
    const size_t eq = kv.find('=');
    if (eq != std::string_view::npos) vars.emplace(std::string(kv.substr(0, eq)), std::string(kv.substr(eq + 1)));
  }
  return rendezvous_endpoint(env, vars);
}

}  // namespace moecore::comm
