#include "moecore/core/mpi_check.h"

#include <cstdio>
#include <string>

namespace moecore {
namespace detail {
void raise_mpi(int code, const char* expr, const char* file, int line) {
  char text[MPI_MAX_ERROR_STRING] = {0};
  int len = 0;
  if (MPI_Error_string(code, text, &len) != MPI_SUCCESS) std::snprintf(text, sizeof text, "unknown MPI error");
  throw Error(concat("MPI call failed: ", expr, ": ", text, " (code ", code, ")"), file, line);
}
}  // namespace detail

void mpi_init(int* argc, char*** argv) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (initialized) return;
  int provided = 0;
  MC_MPI_CHECK(MPI_Init_thread(argc, argv, MPI_THREAD_FUNNELED, &provided));
  MC_MPI_CHECK(MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN));
}

void mpi_finalize() {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (initialized && !finalized) MPI_Finalize();
}

std::string mpi_library_version() {
  char text[MPI_MAX_LIBRARY_VERSION_STRING] = {0};
  int len = 0;
  if (MPI_Get_library_version(text, &len) != MPI_SUCCESS) return "unknown";
  std::string s(text, static_cast<size_t>(len));
  while (!s.empty() && (s.back() == '\n' || s.back() == '\0')) s.pop_back();
  auto nl = s.find(',');  // Open MPI: "Open MPI v4.1.4, package: ..." -> keep the first part
  return nl == std::string::npos ? s : s.substr(0, nl);
}
}  // namespace moecore
