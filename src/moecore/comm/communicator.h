// Communicators: one interface for collectives and point-to-point transfers, two backends.
//
//   make_mpi_world()        MPI over host tensors (CPU; pinned or pageable), device() == cpu
//   make_nccl_world(dev)    NCCL over device tensors on the current stream of dev (cuda:i)
//
// Shapes (all tensors contiguous, one dtype per call, n = size()):
//   all_reduce(t, op)                t: any shape, reduced element-wise in place
//   reduce_scatter(in, out, op)      in: [n*R, ...], out: [R, ...]; rank r gets reduced rows
//                                    [r*R, (r+1)*R) of in. out may be exactly those rows of in
//                                    (in place); no other overlap
//   all_gather(in, out)              in: [R, ...], out: [n*R, ...]; rows [r*R, (r+1)*R) of out
//                                    come from rank r
//   all_to_all(in, sc, out, rc)      in: [sum(sc), ...], out: [sum(rc), ...] (same trailing
//                                    shape); in's rows are grouped by destination (sc[0] rows for
//                                    rank 0, then sc[1] rows for rank 1, ...), out's rows by source
//                                    (rc[r] rows from rank r). Counts may be 0. rc[r] on this rank
//                                    must equal sc[this rank] on rank r (not checkable locally).
//   reduce(t, root, op)              t: any shape; root's t becomes the element-wise reduction
//                                    (in place), the other ranks' t is left as it was
//   broadcast(t, root)               t: any shape, root's values everywhere
//   send(t, peer) / recv(t, peer)    same shape and dtype on both sides; messages between two
//                                    ranks arrive in the order they were sent
// Reduce ops: Sum, Max, Min, Avg (= Sum / n; floating dtypes only, Avg of an integer dtype
// is an Error). Integer sums wrap like the C types (u8 modulo 256).
//
// Dtypes. MPI: f32, f64, bf16, i32, i64, u8. bf16 reductions convert to f32, reduce in f32
// and round once at the end (so a bf16 sum is the correctly rounded fp32 sum; Max/Min are
// exact). NCCL: f32, bf16, i32, i64, u8 (NCCL reduces bf16 with a rounding per hop).
//
// Groups: between group_start() and group_end() (nestable) operations are only issued;
// group_end() completes them all. NCCL: ncclGroupStart/End. MPI: non-blocking requests
// (MPI_Iallreduce, MPI_Isend, ...) waited for at the outermost group_end(); results, and the
// bf16 conversions back, are visible only after it. A group lets every rank post a send and
// a receive (a ring) without deadlock, and a send to this rank itself is allowed only inside
// a group. barrier() inside a group is an Error.
//
// split(ranks): a communicator of the listed ranks OF THIS COMMUNICATOR (global ranks for the
// world), new rank = position in `ranks`. Only the members call it (MPI_Comm_create_group
// underneath; NCCL: a new ncclComm bootstrapped over that MPI communicator), so disjoint groups
// (even/odd ranks) can be created concurrently; all members must pass the same list.
// Exception: an NCCL communicator bootstrapped over TCP (torchrun, no MPI) splits with
// ncclCommSplit, which is collective over ALL ranks of the parent: every rank calls split in
// the same order, each with the list of its own group (nccl_communicator.h). Code that must
// run under both launchers calls split on every rank, as the trainer does.
//
// Asynchronous work: NCCL operations run on the current stream of the device and return at
// once; to overlap communication with compute, record an Event on the compute stream, make a
// communication stream wait for it, issue the operation under a StreamGuard of that stream, and
// make the compute stream wait for an Event recorded after it (train/optimizer.cpp does this for
// --overlap-grad-reduce). One communicator must not run on two streams at the same time: give
// concurrent traffic its own communicator (split). MPI operations complete before returning
// (outside a group).
//
// Errors: every argument error is an Error "comm <call>: <what was wrong>, expected <what>";
// MPI failures surface through MC_MPI_CHECK, NCCL failures through MC_NCCL_CHECK.
// Counts per call must fit MPI's int (2^31-1 elements per message).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "moecore/core/device.h"
#include "moecore/core/error.h"
#include "moecore/core/tensor.h"

namespace moecore::comm {

enum class ReduceOp { Sum, Max, Min, Avg };
const char* reduce_op_name(ReduceOp op);  // "sum", "max", "min", "avg"

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual Device device() const = 0;  // cpu for MPI, cuda:i for NCCL

  virtual void all_reduce(Tensor& t, ReduceOp op) = 0;
  virtual void reduce_scatter(const Tensor& in, Tensor& out, ReduceOp op) = 0;
  virtual void all_gather(const Tensor& in, Tensor& out) = 0;
  virtual void all_to_all(const Tensor& in, const std::vector<int64_t>& send_counts, Tensor& out,
                          const std::vector<int64_t>& recv_counts) = 0;
  virtual void reduce(Tensor& t, int root, ReduceOp op) = 0;
  virtual void broadcast(Tensor& t, int root) = 0;
  virtual void send(const Tensor& t, int peer) = 0;
  virtual void recv(Tensor& t, int peer) = 0;
  virtual void barrier() = 0;

  virtual std::unique_ptr<Communicator> split(const std::vector<int64_t>& ranks) = 0;

  virtual void group_start() = 0;
  virtual void group_end() = 0;

  // The roles this communicator plays ("dp", "ep", ...; parallel::ProcessGroups adds them), so that
  // the collective watchdog names "the dp group of world ranks 0,1". Only before collectives start.
  void add_role(const std::string& role);
  const std::string& roles() const { return roles_; }  // "dp/edp"; "" when none

 protected:
  virtual void roles_changed() {}

 private:
  std::string roles_;
};

// A duplicate of MPI_COMM_WORLD (errors returned). Needs moecore::mpi_init first.
std::unique_ptr<Communicator> make_mpi_world();
// NCCL over all ranks on `device` (cuda:i); rank 0 creates the NCCL id and sends it to the
// others: over MPI when MPI is initialised (moecore::mpi_init; mpirun / srun), else over TCP
// when the launch environment is torchrun's (tcp_rendezvous.h: MASTER_ADDR and the port rule),
// else an Error. An Error on a build without CUDA.
std::unique_ptr<Communicator> make_nccl_world(Device device);

// Host values reduced over a group, in place (element-wise): through MPI in f64, through NCCL in
// f32 (for logged losses and token counts, which are exact in f32 up to 2^24).
void all_reduce_host(Communicator& c, std::vector<double>& values, ReduceOp op = ReduceOp::Sum);

// ---- argument checks shared by the backends -------------------------------------------
// Each raises an Error "comm <call>: ..." naming what was expected.
namespace detail {
void check_tensor(const char* call, const char* name, const Tensor& t, Device device,
                  const std::vector<DType>& supported);
void check_same_dtype(const char* call, const Tensor& a, const Tensor& b);
void check_reduce_op(const char* call, DType dtype, ReduceOp op);
void check_peer(const char* call, const char* what, int peer, int size);
// in: [factor*R, rest...] and out: [R, rest...] (reduce_scatter: big=in; all_gather: big=out).
void check_rows_multiple(const char* call, const char* big_name, const Tensor& big, const char* small_name,
                         const Tensor& small, int factor);
// all_to_all: counts per rank, non-negative, summing to the rows; same trailing shapes.
void check_all_to_all(const Tensor& in, const std::vector<int64_t>& send_counts, const Tensor& out,
                      const std::vector<int64_t>& recv_counts, int size);
// split: non-empty, in range, no duplicates, contains `rank`.
void check_split(const std::vector<int64_t>& ranks, int rank, int size);
std::string dtypes_str(const std::vector<DType>& ds);  // "f32, bf16, i32"
// "the dp group of world ranks 0,2,4,6" (roles "" -> "the group of ..."; the first 16 ranks listed).
std::string describe_group(const std::string& roles, const std::vector<int>& world_ranks);
}  // namespace detail

}  // namespace moecore::comm
