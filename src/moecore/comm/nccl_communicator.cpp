// make_nccl_world on builds without the CUDA backend: a clear Error (the real one is in
// nccl_communicator_cuda.cpp, compiled only with CUDA).
#include "moecore/comm/communicator.h"

#if !MOECORE_WITH_CUDA
namespace moecore::comm {
std::unique_ptr<Communicator> make_nccl_world(Device device) {
  MC_FAIL("comm make_nccl_world: this build has no CUDA backend, expected a build with -DMOECORE_CUDA=ON "
          "(use make_mpi_world for host tensors)");
}
}  // namespace moecore::comm
#endif
