// TCP rendezvous: rank 0 hands a few bytes (the NCCL unique id) to every other rank of a job
// started without MPI (torchrun). POSIX sockets only; no CUDA, no MPI.
//
// tcp_broadcast(addr, port, rank, world, payload_on_rank0, timeout_s, ports, job_key)
//   -> rank 0's payload. The candidate ports are [port, port + ports).
//   rank 0:  listens on the first candidate it can bind (another process holding one, even as
//            the local end of an outgoing connection, makes it skip to the next), on every
//            interface (IPv6 socket accepting IPv4 too, or IPv4 only where the host has no IPv6;
//            SO_REUSEADDR), and serves each of the world-1 peers as it connects, in any order.
//            Returns payload_on_rank0.
//   rank r:  resolves `addr` (getaddrinfo: host name, IPv4 or IPv6 literal) and tries the
//            candidates in order, round after round every 100 ms until timeout_s (rank 0 may
//            start later); it takes the first whose rank 0 answers with moecore's header. With
//            one candidate a listener that is not moecore's is an error at once; with several
//            it is skipped (a candidate rank 0 skipped may be held by anything). Returns the
//            payload it received. `payload_on_rank0` is ignored.
//   world == 1: returns payload_on_rank0 without opening a socket.
// Wire format (integers little-endian):
//   peer -> rank 0   hello  : u32 magic 0x5652434D ("MCRV"), u32 version 2, u32 world, u32 rank,
//                             u32 job_key
//   rank 0 -> peer   header : u32 magic, u32 world, u64 length (<= 1 MiB), then `length` bytes
// Rank 0 closes connections whose hello is not moecore's (a port scanner, a health check) or
// carries another job_key (another job's rank, scanning the same ports): that peer moves on.
// Both sides compare WORLD_SIZE: a mismatch is an Error on the peer and on rank 0 naming both
// values; so are two processes claiming one rank, or a rank outside [1, world).
// Errors ("tcp rendezvous (rank r of n): ...") name MASTER_ADDR and the rendezvous port(s), what
// happened (connection refused / timeout after N s / bad header / short read / port in use)
// and what was expected.
//
// Port rule (rendezvous_endpoint), for torchrun environments; job_key is MASTER_PORT:
//   1. MOECORE_RENDEZVOUS_PORT, when set (1..65535): that port only;
//   2. MASTER_PORT + 1 .. MASTER_PORT + 8 (MASTER_PORT - 8 .. MASTER_PORT - 1 when that would
//      pass 65535) when TORCHELASTIC_USE_AGENT_STORE=True: torchrun's elastic agent on the first
//      node then hosts its own TCPStore on MASTER_ADDR:MASTER_PORT (the c10d rendezvous of
//      --standalone and of --rdzv-backend c10d shares its store with the workers in recent
//      PyTorch), so that port is taken, and a port next to it may be the local end of one of
//      the agent's connections (seen on a GPU machine: MASTER_PORT+1 in use);
//   3. MASTER_PORT otherwise (the agent picked a free port for the workers' rank 0 to bind, as
//      torch.distributed.init_process_group's own TCPStore does).
// The host is MASTER_ADDR (global rank 0 runs on the agent's first node). The timeout is
// MOECORE_RENDEZVOUS_TIMEOUT seconds when set (> 0), else 300.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "moecore/comm/bootstrap.h"

namespace moecore::comm {

std::vector<uint8_t> tcp_broadcast(const std::string& addr, int port, int rank, int world,
                                   const std::vector<uint8_t>& payload_on_rank0, double timeout_s, int ports = 1,
                                   uint32_t job_key = 0);

struct RendezvousEndpoint {
  std::string addr;  // MASTER_ADDR
  int port = 0;      // the first candidate
  int ports = 1;     // candidates [port, port + ports)
  uint32_t job_key = 0;
  double timeout_s = 300;
  std::string port_rule;  // how the port was chosen, for messages ("MASTER_PORT+1 (...)")
};

// The port rule above, for a torchrun LaunchEnv (read_launch_env) and the environment `vars`.
RendezvousEndpoint rendezvous_endpoint(const LaunchEnv& env, const std::map<std::string, std::string>& vars);
RendezvousEndpoint rendezvous_endpoint(const LaunchEnv& env);  // the process environment

}  // namespace moecore::comm
