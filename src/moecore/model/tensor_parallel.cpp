#include "moecore/model/tensor_parallel.h"

#include "moecore/ops/elementwise.h"

namespace moecore {

namespace {
Shape with_rows(const Tensor& t, int64_t rows) {
  Shape s = t.shape();
  s[0] = rows;
  return s;
}
}  // namespace

Tensor gather_sequence(comm::Communicator& group, const Tensor& x, int64_t batch) {
  const int64_t n = group.size(), rows = x.size(0);
  MC_CHECK(rows % batch == 0, "gather_sequence: ", x.describe(), " does not split into ", batch, " sequences");
  const int64_t width = x.numel() / rows * (rows / batch);
  Tensor gathered = Tensor::empty(with_rows(x, rows * n), x.dtype(), x.device());
  group.all_gather(x.contiguous(), gathered);
  if (batch == 1 || n == 1) return gathered;
  // gathered is [n, B, s, ...] (rank-major): reorder to [B, n, s, ...].
  Tensor out = Tensor::empty(gathered.shape(), x.dtype(), x.device());
  const Tensor src = gathered.view({n, batch, width});
  const Tensor dst = out.view({batch, n, width});
  for (int64_t r = 0; r < n; ++r) {
    Tensor d = dst.slice(1, r, r + 1);
    d.copy_from(src.slice(0, r, r + 1).view({batch, 1, width}));
  }
  return out;
}

Tensor reduce_scatter_sequence(comm::Communicator& group, const Tensor& x, int64_t batch) {
  const int64_t n = group.size(), rows = x.size(0);
  MC_CHECK(rows % (n * batch) == 0, "reduce_scatter_sequence: ", x.describe(), " does not split into ", batch,
           " sequences over ", n, " ranks");
  const int64_t width = x.numel() / rows * (rows / batch / n);
  Tensor send = x.contiguous();
  if (batch > 1 && n > 1) {  // [B, n, s, ...] -> [n, B, s, ...] (rank-major for the reduce-scatter)
    send = Tensor::empty(x.shape(), x.dtype(), x.device());
    const Tensor src = x.contiguous().view({batch, n, width});
    const Tensor dst = send.view({n, batch, width});
    for (int64_t r = 0; r < n; ++r) {
      Tensor d = dst.slice(0, r, r + 1).view({batch, 1, width});
      d.copy_from(src.slice(1, r, r + 1));
    }
  }
  Tensor out = Tensor::empty(with_rows(x, rows / n), x.dtype(), x.device());
  group.reduce_scatter(send, out, comm::ReduceOp::Sum);
  return out;
}

std::vector<int32_t> DenseParallel::token_positions(int64_t batch, int64_t cp_seq) const {
  const int64_t cp = cp_size(), c = cp_seq / 2;
  const int64_t local = local_tokens(cp_seq), first = sp() ? tp_rank() * local : 0;
  std::vector<int32_t> pos;
  pos.reserve(static_cast<size_t>(batch * local));
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t j = first; j < first + local; ++j)
      pos.push_back(static_cast<int32_t>(cp > 1 ? cp_chunk_start(c, cp, cp_rank(), j < c ? 0 : 1) + j % c : j));
  return pos;
}

Tensor DenseParallel::enter_forward(const Tensor& x, int64_t batch) const {
  if (!tp) return x;
  return sequence_parallel ? gather_sequence(*tp, x, batch) : x;
}

Tensor DenseParallel::enter_backward(const Tensor& dx, int64_t batch) const {
  if (!tp) return dx;
  if (sequence_parallel) return reduce_scatter_sequence(*tp, dx, batch);
  Tensor out = dx.contiguous();
  tp->all_reduce(out, comm::ReduceOp::Sum);
  return out;
}

Tensor DenseParallel::exit_forward(const Tensor& y, int64_t batch) const {
  if (!tp) return y;
  if (sequence_parallel) return reduce_scatter_sequence(*tp, y, batch);
  Tensor out = y.contiguous();
  tp->all_reduce(out, comm::ReduceOp::Sum);
  return out;
}

Tensor DenseParallel::exit_backward(const Tensor& dy, int64_t batch) const {
  if (!tp) return dy;
  return sequence_parallel ? gather_sequence(*tp, dy, batch) : dy;
}

Tensor seq_range(const Tensor& t, int64_t begin, int64_t end) { return t.slice(1, begin, end).contiguous(); }

void seq_assign(Tensor& dst, int64_t begin, const Tensor& src) {
  Tensor window = dst.slice(1, begin, begin + src.size(1));
  window.copy_from(src);
}

void seq_accumulate(Tensor& dst, int64_t begin, const Tensor& src) {
  Tensor window = dst.slice(1, begin, begin + src.size(1));
  if (window.is_contiguous()) {
    ops::add(window, src, window);
    return;
  }
  Tensor sum = window.contiguous();
  ops::add(sum, src, sum);
  window.copy_from(sum);
}

Tensor context_parallel_slice(const Tensor& t, int64_t cp_size, int64_t cp_rank) {
  if (cp_size == 1) return t;
  const int64_t seq = t.size(1);
  MC_CHECK(t.ndim() == 2 && seq % (2 * cp_size) == 0, "context parallelism: a sequence of ", seq,
           " tokens does not split into 2 x --context-parallel-size = ", 2 * cp_size, " chunks");
  const int64_t c = seq / (2 * cp_size);
  Tensor out = Tensor::empty({t.size(0), 2 * c}, t.dtype(), t.device());
  for (int chunk = 0; chunk < 2; ++chunk) {
    const int64_t start = cp_chunk_start(c, cp_size, cp_rank, chunk);
    seq_assign(out, chunk * c, seq_range(t, start, start + c));
  }
  return out;
}

}  // namespace moecore
