// Checked wrapper for MPI calls. MPI's default handler aborts without a useful message;
// moecore::mpi_init() switches MPI_COMM_WORLD to MPI_ERRORS_RETURN so that failures reach
// MC_MPI_CHECK, which raises an Error with MPI's own error string.
#pragma once

#include <mpi.h>

#include "moecore/core/error.h"

namespace moecore {
namespace detail {
[[noreturn]] void raise_mpi(int code, const char* expr, const char* file, int line);
}
// MPI_Init_thread (MPI_THREAD_FUNNELED) once per process, with errors returned; idempotent.
void mpi_init(int* argc, char*** argv);
// MPI_Finalize if mpi_init initialised MPI and it is not finalised yet.
void mpi_finalize();
// The MPI library's version string (callable before MPI_Init).
std::string mpi_library_version();
}  // namespace moecore

#define MC_MPI_CHECK(expr)                                                                  \
  do {                                                                                      \
    int mc_rc_ = (expr);                                                                    \
    if (mc_rc_ != MPI_SUCCESS) ::moecore::detail::raise_mpi(mc_rc_, #expr, __FILE__, __LINE__); \
  } while (0)
