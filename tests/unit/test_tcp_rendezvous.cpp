// tcp_broadcast (comm/tcp_rendezvous.h): "ranks" are threads of this process on the loopback
// interface, each with its own socket. Also the torchrun port rule (rendezvous_endpoint) and the
// torchrun device check (comm::check_torchrun_devices in bootstrap.h).
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "moecore/comm/bootstrap.h"
#include "moecore/comm/tcp_rendezvous.h"
#include "moecore/core/error.h"

using namespace moecore;
using namespace moecore::comm;

namespace {

// A listening IPv4 socket on every interface with a port chosen by the kernel; port() tells it.
struct Listener {
  int fd = -1;
  Listener() {
    fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_ANY);
    a.sin_port = 0;
    EXPECT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
    EXPECT_EQ(::listen(fd, 4), 0);
  }
  ~Listener() { close(); }
  void close() {
    if (fd >= 0) ::close(fd);
    fd = -1;
  }
  int port() const {
    sockaddr_in a{};
    socklen_t len = sizeof a;
    ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
    return ntohs(a.sin_port);
  }
};

// A socket bound to `port` (0: the kernel's choice) without listening, as the local end of an
// outgoing connection holds its port: binding that port fails, connecting to it is refused.
// fd < 0 when the port could not be bound.
struct Bound {
  int fd = -1;
  explicit Bound(int port = 0) {
    fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_ANY);
    a.sin_port = htons(static_cast<uint16_t>(port));
    if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
      ::close(fd);
      fd = -1;
    }
  }
  ~Bound() {
    if (fd >= 0) ::close(fd);
  }
  int port() const {
    sockaddr_in a{};
    socklen_t len = sizeof a;
    ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
    return ntohs(a.sin_port);
  }
};

int free_port() {
  Listener l;
  return l.port();  // closed again: free for the test (a race with other processes is unlikely)
}

struct Outcome {
  std::vector<uint8_t> data;
  std::string error;  // empty: no exception
};

// Runs every function on its own thread; their results or Error messages, in order.
std::vector<Outcome> run_all(const std::vector<std::function<std::vector<uint8_t>()>>& fns) {
  std::vector<Outcome> out(fns.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < fns.size(); ++i)
    threads.emplace_back([&, i] {
      try {
        out[i].data = fns[i]();
      } catch (const std::exception& e) {
        out[i].error = e.what();
        if (out[i].error.empty()) out[i].error = "(empty message)";
      }
    });
  for (auto& t : threads) t.join();
  return out;
}

std::vector<uint8_t> pattern(size_t n) {
  std::vector<uint8_t> p(n);
  for (size_t i = 0; i < n; ++i) p[i] = static_cast<uint8_t>(i * 37 + 11);
  return p;
}

}  // namespace

TEST(TcpRendezvous, DeliversRankZerosPayloadToEveryRank) {
  const int port = free_port(), world = 4;
  const std::vector<uint8_t> payload = pattern(128);  // the size of an ncclUniqueId
  std::vector<std::function<std::vector<uint8_t>()>> ranks;
  for (int r = 0; r < world; ++r)
    ranks.push_back([&, r] {
      // Other ranks pass garbage as their payload: only rank 0's counts.
      return tcp_broadcast("127.0.0.1", port, r, world, r == 0 ? payload : pattern(5), 20.0);
    });
  const auto out = run_all(ranks);
  for (int r = 0; r < world; ++r) {
    EXPECT_EQ(out[r].error, "") << "rank " << r;
    EXPECT_EQ(out[r].data, payload) << "rank " << r;
  }
}

TEST(TcpRendezvous, HostNameAndEmptyPayload) {
  const int port = free_port();
  std::vector<std::function<std::vector<uint8_t>()>> ranks;
  for (int r = 0; r < 3; ++r) ranks.push_back([&, r] { return tcp_broadcast("localhost", port, r, 3, {}, 20.0); });
  for (const auto& o : run_all(ranks)) {
    EXPECT_EQ(o.error, "");
    EXPECT_TRUE(o.data.empty());
  }
}

TEST(TcpRendezvous, RankZeroStartingOneSecondLateStillWorks) {
  const int port = free_port(), world = 4;
  const std::vector<uint8_t> payload = pattern(64);
  std::vector<std::function<std::vector<uint8_t>()>> ranks;
  ranks.push_back([&] {
    std::this_thread::sleep_for(std::chrono::seconds(1));
    return tcp_broadcast("127.0.0.1", port, 0, world, payload, 20.0);
  });
  for (int r = 1; r < world; ++r)
    ranks.push_back([&, r] { return tcp_broadcast("127.0.0.1", port, r, world, {}, 20.0); });
  const auto t0 = std::chrono::steady_clock::now();
  const auto out = run_all(ranks);
  EXPECT_GE(std::chrono::steady_clock::now() - t0, std::chrono::milliseconds(900));
  for (int r = 0; r < world; ++r) {
    EXPECT_EQ(out[r].error, "") << "rank " << r;
    EXPECT_EQ(out[r].data, payload) << "rank " << r;
  }
}

TEST(TcpRendezvous, WorldSizeMismatchIsAnErrorOnBothSidesNamingBothValues) {
  const int port = free_port();
  const auto out = run_all({[&] { return tcp_broadcast("127.0.0.1", port, 0, 2, pattern(8), 10.0); },
                            [&] { return tcp_broadcast("127.0.0.1", port, 1, 3, {}, 10.0); }});
  for (const auto& o : out) {
    EXPECT_NE(o.error.find("WORLD_SIZE mismatch"), std::string::npos) << o.error;
    EXPECT_NE(o.error.find("WORLD_SIZE=2"), std::string::npos) << o.error;
    EXPECT_NE(o.error.find("WORLD_SIZE=3"), std::string::npos) << o.error;
  }
}

TEST(TcpRendezvous, NoRankZeroIsATimeoutNamingTheAddressAndRefusal) {
  const int port = free_port();
  const auto t0 = std::chrono::steady_clock::now();
  try {
    tcp_broadcast("127.0.0.1", port, 1, 2, {}, 1.0);
    FAIL() << "expected an Error";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("tcp rendezvous (rank 1 of 2)"), std::string::npos) << m;
    EXPECT_NE(m.find("timeout after 1 s"), std::string::npos) << m;
    EXPECT_NE(m.find("MASTER_ADDR=127.0.0.1 port " + std::to_string(port)), std::string::npos) << m;
    EXPECT_NE(m.find("connection refused"), std::string::npos) << m;
    EXPECT_NE(m.find("expected rank 0 to listen there"), std::string::npos) << m;
  }
  const auto waited = std::chrono::steady_clock::now() - t0;
  EXPECT_GE(waited, std::chrono::milliseconds(900));
  EXPECT_LT(waited, std::chrono::seconds(5));
}

TEST(TcpRendezvous, RankZeroTimesOutNamingTheMissingRanks) {
  const int port = free_port();
  const auto out = run_all({[&] { return tcp_broadcast("127.0.0.1", port, 0, 3, pattern(8), 1.5); },
                            [&] { return tcp_broadcast("127.0.0.1", port, 1, 3, {}, 10.0); }});
  EXPECT_EQ(out[1].error, "");
  EXPECT_EQ(out[1].data, pattern(8));
  EXPECT_NE(out[0].error.find("timeout after 1.5 s"), std::string::npos) << out[0].error;
  EXPECT_NE(out[0].error.find("for rank(s) 2 (1 of 2 connected)"), std::string::npos) << out[0].error;
}

TEST(TcpRendezvous, RankZeroIgnoresStrangersAndRefusesDuplicateRanks) {
  const int port = free_port();
  auto out = run_all({[&] { return tcp_broadcast("127.0.0.1", port, 0, 3, pattern(8), 10.0); },
                      [&] {
                        // A stranger connects first and sends nonsense; rank 0 must carry on.
                        std::this_thread::sleep_for(std::chrono::milliseconds(300));
                        int fd = ::socket(AF_INET, SOCK_STREAM, 0);
                        sockaddr_in a{};
                        a.sin_family = AF_INET;
                        a.sin_port = htons(static_cast<uint16_t>(port));
                        a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
                        EXPECT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
                        const char junk[] = "GET / HTTP/1.0\r\n\r\n";
                        EXPECT_GT(::send(fd, junk, sizeof junk - 1, MSG_NOSIGNAL), 0);
                        ::close(fd);
                        return std::vector<uint8_t>{};
                      },
                      [&] {
                        std::this_thread::sleep_for(std::chrono::milliseconds(600));
                        return tcp_broadcast("127.0.0.1", port, 1, 3, {}, 10.0);
                      },
                      [&] {
                        std::this_thread::sleep_for(std::chrono::milliseconds(900));
                        return tcp_broadcast("127.0.0.1", port, 2, 3, {}, 10.0);
                      }});
  for (const auto& o : out) EXPECT_EQ(o.error, "");
  EXPECT_EQ(out[2].data, pattern(8));
  EXPECT_EQ(out[3].data, pattern(8));

  const int port2 = free_port();
  out = run_all({[&] { return tcp_broadcast("127.0.0.1", port2, 0, 3, pattern(8), 10.0); },
                 [&] { return tcp_broadcast("127.0.0.1", port2, 1, 3, {}, 10.0); },
                 [&] {
                   std::this_thread::sleep_for(std::chrono::milliseconds(500));
                   return tcp_broadcast("127.0.0.1", port2, 1, 3, {}, 3.0);
                 }});
  EXPECT_NE(out[0].error.find("two processes claim RANK=1"), std::string::npos) << out[0].error;
}

TEST(TcpRendezvous, AnotherServiceOnThePortGivesBadHeaderOrShortRead) {
  for (const bool send_junk : {true, false}) {
    Listener service;
    const int port = service.port();
    std::thread server([&] {
      const int c = ::accept(service.fd, nullptr, nullptr);
      char hello[20];
      EXPECT_EQ(::recv(c, hello, sizeof hello, MSG_WAITALL), 20);
      if (send_junk) {
        const char junk[16] = "HTTP/1.1 400 Ba";
        ::send(c, junk, sizeof junk, MSG_NOSIGNAL);
      } else {
        ::send(c, "MC", 2, MSG_NOSIGNAL);  // 2 of 16 header bytes, then close
      }
      ::close(c);
    });
    std::string m;
    try {
      tcp_broadcast("127.0.0.1", port, 2, 4, {}, 5.0);
    } catch (const Error& e) {
      m = e.what();
    }
    server.join();
    if (send_junk) {
      EXPECT_NE(m.find("bad header from MASTER_ADDR=127.0.0.1 port " + std::to_string(port)), std::string::npos) << m;
      EXPECT_NE(m.find("another service listens on that port"), std::string::npos) << m;
    } else {
      EXPECT_NE(m.find("short read"), std::string::npos) << m;
      EXPECT_NE(m.find("after 2 of 16 bytes of the header"), std::string::npos) << m;
    }
  }
}

TEST(TcpRendezvous, PortInUseOnRankZeroSaysHowToChooseAnother) {
  Listener busy;
  try {
    tcp_broadcast("127.0.0.1", busy.port(), 0, 2, {}, 1.0);
    FAIL() << "expected an Error";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("cannot listen on port " + std::to_string(busy.port())), std::string::npos) << m;
    EXPECT_NE(m.find("MOECORE_RENDEZVOUS_PORT"), std::string::npos) << m;
  }
}

// torchrun's agent may hold the port after MASTER_PORT as the local end of a connection (seen on
// a GPU machine): with several candidates rank 0 binds the next one and the peers find it there.
TEST(TcpRendezvous, RankZeroSkipsACandidateHeldByAnotherSocket) {
  Bound held;
  ASSERT_GE(held.fd, 0);
  const int port = held.port();
  if (port + 4 > 65535) GTEST_SKIP() << "kernel port " << port << " leaves no room for the candidates";
  // One candidate: the held port is an error naming it.
  try {
    tcp_broadcast("127.0.0.1", port, 0, 2, {}, 1.0);
    FAIL() << "expected an Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("cannot listen on port " + std::to_string(port)), std::string::npos) << e.what();
  }
  std::vector<std::function<std::vector<uint8_t>()>> ranks;
  for (int r = 0; r < 3; ++r)
    ranks.push_back([&, r] { return tcp_broadcast("127.0.0.1", port, r, 3, r == 0 ? pattern(16) : pattern(2), 20.0, 4, 7); });
  const auto out = run_all(ranks);
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(out[r].error, "") << "rank " << r;
    EXPECT_EQ(out[r].data, pattern(16)) << "rank " << r;
  }
}

// Another job's rank 0 on the first candidate (another job_key): it closes this job's peers, which
// go on to this job's rank 0 on the next candidate; each job's ranks get their own payload.
TEST(TcpRendezvous, PeersPassAnotherJobsRankZero) {
  const int port = free_port();
  if (port + 3 > 65535) GTEST_SKIP() << "kernel port " << port << " leaves no room for the candidates";
  auto later = [](int ms, std::function<std::vector<uint8_t>()> f) {
    return [ms, f] {
      std::this_thread::sleep_for(std::chrono::milliseconds(ms));
      return f();
    };
  };
  const auto out = run_all({
      [&] { return tcp_broadcast("127.0.0.1", port, 0, 2, pattern(8), 20.0, 1, 111); },               // job A
      later(300, [&] { return tcp_broadcast("127.0.0.1", port, 0, 2, pattern(24), 20.0, 3, 222); }),  // job B
      later(600, [&] { return tcp_broadcast("127.0.0.1", port, 1, 2, {}, 20.0, 3, 222); }),
      later(900, [&] { return tcp_broadcast("127.0.0.1", port, 1, 2, {}, 20.0, 1, 111); }),
  });
  for (const auto& o : out) EXPECT_EQ(o.error, "");
  EXPECT_EQ(out[2].data, pattern(24)) << "job B's peer";
  EXPECT_EQ(out[3].data, pattern(8)) << "job A's peer";
}

TEST(TcpRendezvous, EveryCandidateHeldNamesTheRange) {
  Bound first;
  ASSERT_GE(first.fd, 0);
  const int port = first.port();
  Bound second(port + 1);
  if (second.fd < 0 || port + 1 > 65535) GTEST_SKIP() << "port " << port + 1 << " is not free";
  try {
    tcp_broadcast("127.0.0.1", port, 0, 2, {}, 1.0, 2, 5);
    FAIL() << "expected an Error";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("cannot listen on any of ports " + std::to_string(port) + ".." + std::to_string(port + 1)),
              std::string::npos)
        << m;
    EXPECT_NE(m.find("MOECORE_RENDEZVOUS_PORT"), std::string::npos) << m;
  }
  // A peer that finds no rank 0 on any candidate names the range and the last refusal.
  try {
    tcp_broadcast("127.0.0.1", port, 1, 2, {}, 0.5, 2, 5);
    FAIL() << "expected an Error";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("ports " + std::to_string(port) + ".." + std::to_string(port + 1) + " (last error, port " +
                     std::to_string(port + 1) + ": connection refused)"),
              std::string::npos)
        << m;
  }
}

TEST(TcpRendezvous, BadArguments) {
  EXPECT_THROW(tcp_broadcast("127.0.0.1", 0, 0, 2, {}, 1.0), Error);
  EXPECT_THROW(tcp_broadcast("127.0.0.1", 1234, 2, 2, {}, 1.0), Error);
  EXPECT_THROW(tcp_broadcast("127.0.0.1", 1234, 1, 2, {}, 0.0), Error);
  EXPECT_THROW(tcp_broadcast("127.0.0.1", 65535, 1, 2, {}, 1.0, 2), Error);  // the second candidate is past 65535
  EXPECT_THROW(tcp_broadcast("127.0.0.1", 1234, 1, 2, {}, 1.0, 0), Error);
  // One rank: no socket at all (port 1 would need root).
  EXPECT_EQ(tcp_broadcast("127.0.0.1", 1, 0, 1, pattern(3), 1.0), pattern(3));
}

TEST(TcpRendezvous, PortRuleForTorchrun) {
  LaunchEnv env = read_launch_env({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "2"},
                                   {"MASTER_ADDR", "node0"}, {"MASTER_PORT", "29500"}});
  RendezvousEndpoint ep = rendezvous_endpoint(env, {});
  EXPECT_EQ(ep.addr, "node0");
  EXPECT_EQ(ep.port, 29500);  // the agent left MASTER_PORT free for the workers' rank 0
  EXPECT_EQ(ep.ports, 1);
  EXPECT_EQ(ep.job_key, 29500u);
  EXPECT_EQ(ep.timeout_s, 300);
  ep = rendezvous_endpoint(env, {{"TORCHELASTIC_USE_AGENT_STORE", "False"}});
  EXPECT_EQ(ep.port, 29500);
  ep = rendezvous_endpoint(env, {{"TORCHELASTIC_USE_AGENT_STORE", "True"}});
  EXPECT_EQ(ep.port, 29501);  // the agent's TCPStore holds MASTER_PORT
  EXPECT_EQ(ep.ports, 8);     // its connections may hold the next ones
  EXPECT_EQ(ep.job_key, 29500u);
  EXPECT_NE(ep.port_rule.find("MASTER_PORT+1..+8, the first free"), std::string::npos) << ep.port_rule;
  ep = rendezvous_endpoint(env, {{"TORCHELASTIC_USE_AGENT_STORE", "True"}, {"MOECORE_RENDEZVOUS_PORT", "4242"},
                                 {"MOECORE_RENDEZVOUS_TIMEOUT", "2.5"}});
  EXPECT_EQ(ep.port, 4242);
  EXPECT_EQ(ep.ports, 1);  // a port the user chose: that one only
  EXPECT_EQ(ep.timeout_s, 2.5);
  env.master_port = 65530;  // MASTER_PORT+8 would pass 65535: the 8 ports below it
  ep = rendezvous_endpoint(env, {{"TORCHELASTIC_USE_AGENT_STORE", "True"}});
  EXPECT_EQ(ep.port, 65522);
  EXPECT_EQ(ep.ports, 8);
  EXPECT_NE(ep.port_rule.find("MASTER_PORT-8..-1"), std::string::npos) << ep.port_rule;
  env.master_port = 65535;
  try {
    rendezvous_endpoint(env, {{"MOECORE_RENDEZVOUS_PORT", "70000"}});
    FAIL() << "expected an Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("MOECORE_RENDEZVOUS_PORT='70000', expected a port in 1..65535"),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW(rendezvous_endpoint(env, {{"MOECORE_RENDEZVOUS_TIMEOUT", "-1"}}), Error);
  EXPECT_THROW(rendezvous_endpoint(read_launch_env({}), {}), Error);  // no MASTER_ADDR: not torchrun
}

TEST(TorchrunDevices, OneGpuPerLocalRankAndNoCpuRanks) {
  auto env_of = [](int local_rank, int local_world, int world) {
    return read_launch_env({{"RANK", std::to_string(local_rank)},
                            {"WORLD_SIZE", std::to_string(world)},
                            {"LOCAL_RANK", std::to_string(local_rank)},
                            {"LOCAL_WORLD_SIZE", std::to_string(local_world)},
                            {"MASTER_ADDR", "127.0.0.1"},
                            {"MASTER_PORT", "29500"}});
  };
  auto message = [](const std::function<void()>& f) {
    try {
      f();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  // Fine: 2 ranks, 2 GPUs; a single torchrun rank on the CPU; 8 GPUs for 2 ranks.
  EXPECT_EQ(message([&] { check_torchrun_devices(env_of(1, 2, 2), 2, Device::cuda(1), false); }), "");
  EXPECT_EQ(message([&] { check_torchrun_devices(env_of(0, 1, 1), 0, Device::cpu(), false); }), "");
  EXPECT_EQ(message([&] { check_torchrun_devices(env_of(1, 2, 2), 8, Device::cuda(1), false); }), "");
  // torchrun --virtual-local-rank: LOCAL_RANK=0 and one visible GPU per worker.
  EXPECT_EQ(message([&] { check_torchrun_devices(env_of(0, 4, 4), 1, Device::cuda(0), false); }), "");
  // CPU ranks need MPI.
  std::string m = message([&] { check_torchrun_devices(env_of(1, 2, 2), 0, Device::cpu(), false); });
  EXPECT_NE(m.find("torchrun with WORLD_SIZE=2 needs CUDA devices"), std::string::npos) << m;
  EXPECT_NE(m.find("launch CPU ranks with mpirun or srun"), std::string::npos) << m;
  m = message([&] { check_torchrun_devices(env_of(1, 2, 2), 2, Device::cpu(), true); });
  EXPECT_NE(m.find("mpirun or srun"), std::string::npos) << m;
  // More local ranks than GPUs.
  m = message([&] { check_torchrun_devices(env_of(3, 4, 4), 2, Device::cuda(1), false); });
  EXPECT_NE(m.find("LOCAL_WORLD_SIZE=4 ranks on this node but 2 CUDA device(s) are visible"), std::string::npos) << m;
  EXPECT_NE(m.find("--nproc-per-node <= 2"), std::string::npos) << m;
  // --device chosen explicitly: the user's choice; other launchers: not torchrun's business.
  EXPECT_EQ(message([&] { check_torchrun_devices(env_of(3, 4, 4), 2, Device::cuda(1), true); }), "");
  const LaunchEnv mpi = read_launch_env({{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "4"},
                                         {"OMPI_COMM_WORLD_LOCAL_RANK", "1"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"}});
  EXPECT_EQ(message([&] { check_torchrun_devices(mpi, 0, Device::cpu(), false); }), "");
}
