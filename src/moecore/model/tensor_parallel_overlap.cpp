// --tp-comm-overlap: the chunked sequence gather and reduce-scatter of model/tensor_parallel.h.
//
// Streams (a GPU): the collectives of the chunks run on one communication stream per device
// (created once, kept for the process, like moe/side_stream's side stream). It first waits for
// an event recorded on the current (compute) stream, so it reads inputs that are ready and runs
// after the compute stream's earlier collectives on the group; the compute stream waits for an
// event recorded after a chunk's collective before it reads the chunk, and for the last one
// before returning, so the group is never busy on both streams at once and no host waits.
// Every buffer is allocated on the compute stream before the collectives are issued (the
// caching allocator keys blocks by stream; the compute stream's later reuse of them is ordered
// after its waits). On the CPU (MPI) streams and events are no-ops: the same calls, in order.
#include <algorithm>
#include <map>
#include <memory>
#include <optional>

#include "moecore/model/tensor_parallel.h"

namespace moecore {

namespace {

Stream comm_stream_of(Device device) {
  static std::map<int, Stream> streams;  // the training loop's thread; kept for the process
  Stream& s = streams[device.index];
  if (!s.handle()) s = Stream::create(device);
  return s;
}

// An event recorded now on the current stream of `device` (null on the CPU).
std::unique_ptr<Event> record_here(Device device) {
  if (!device.is_cuda()) return nullptr;
  auto e = std::make_unique<Event>(device);
  e->record();
  return e;
}

void wait_on(const std::unique_ptr<Event>& e, Stream stream) {
  if (e) e->wait(stream);
}

Shape with_rows(const Tensor& t, int64_t rows) {
  Shape s = t.shape();
  s[0] = rows;
  return s;
}

}  // namespace

RowChunks::RowChunks(int64_t ranks_, int64_t batch_, int64_t local_rows) : ranks(ranks_), batch(batch_) {
  MC_CHECK(batch > 0 && local_rows % batch == 0 && local_rows > 0, "--tp-comm-overlap: ", local_rows,
           " tokens per rank do not split into ", batch, " sequences");
  seq = local_rows / batch;
  count = std::min(ranks, local_rows);
}

int64_t RowChunks::begin(int64_t c) const {
  const int64_t rows = batch * seq, base = rows / count, extra = rows % count;
  return c * base + std::min(c, extra);
}

std::vector<RowChunks::Run> RowChunks::runs(int64_t c) const {
  const int64_t b0 = begin(c), b1 = end(c), len = b1 - b0;
  std::vector<Run> out;
  for (int64_t r = 0; r < ranks; ++r)
    for (int64_t b = b0 / seq; b * seq < b1; ++b) {
      const int64_t lo = std::max(b0, b * seq), hi = std::min(b1, (b + 1) * seq);
      out.push_back({r * len + (lo - b0), (b * ranks + r) * seq + (lo - b * seq), hi - lo});
    }
  return out;
}

Tensor RowChunks::take(const Tensor& full, int64_t c) const {
  Tensor out = Tensor::empty(with_rows(full, ranks * len(c)), full.dtype(), full.device());
  for (const Run& run : runs(c)) {
    Tensor dst = out.slice(0, run.at, run.at + run.rows);
    dst.copy_from(full.slice(0, run.full, run.full + run.rows));
  }
  return out;
}

void RowChunks::put(Tensor& full, int64_t c, const Tensor& rows) const {
  for (const Run& run : runs(c)) {
    Tensor dst = full.slice(0, run.full, run.full + run.rows);
    dst.copy_from(rows.slice(0, run.at, run.at + run.rows));
  }
}

Tensor gather_sequence_chunked(comm::Communicator& group, const Tensor& x_in, int64_t batch,
                               const std::function<void(int64_t, const Tensor&)>& consume) {
  const Tensor x = x_in.contiguous();
  const Device dev = x.device();
  const RowChunks k(group.size(), batch, x.size(0));
  Tensor full = Tensor::empty(with_rows(x, x.size(0) * k.ranks), x.dtype(), dev);
  std::vector<Tensor> got(static_cast<size_t>(k.count));
  for (int64_t c = 0; c < k.count; ++c)
    got[static_cast<size_t>(c)] = Tensor::empty(with_rows(x, k.ranks * k.len(c)), x.dtype(), dev);
  // Every chunk's all-gather on the communication stream, back to back; each one's event.
  std::vector<std::unique_ptr<Event>> arrived(static_cast<size_t>(k.count));
  {
    const std::unique_ptr<Event> inputs_ready = record_here(dev);
    std::optional<StreamGuard> on_comm;
    if (dev.is_cuda()) {
      wait_on(inputs_ready, comm_stream_of(dev));
      on_comm.emplace(comm_stream_of(dev));
    }
    for (int64_t c = 0; c < k.count; ++c) {
      group.all_gather(x.slice(0, k.begin(c), k.end(c)), got[static_cast<size_t>(c)]);
      arrived[static_cast<size_t>(c)] = record_here(dev);
    }
  }
  // The compute stream: chunk c's GEMMs as soon as it arrived, while the next ones travel.
  for (int64_t c = 0; c < k.count; ++c) {
    const Tensor& rows = got[static_cast<size_t>(c)];
    wait_on(arrived[static_cast<size_t>(c)], current_stream(dev));
    consume(c, rows);
    k.put(full, c, rows);
  }
  return full;
}

Tensor reduce_scatter_sequence_chunked(comm::Communicator& group, int64_t local_rows, int64_t width, int64_t batch,
                                       DType dtype, Device dev, const std::function<Tensor(int64_t)>& produce,
                                       const std::function<void()>& meanwhile) {
  const RowChunks k(group.size(), batch, local_rows);
  Tensor out = Tensor::empty({local_rows, width}, dtype, dev);
  std::vector<Tensor> partial(static_cast<size_t>(k.count));  // alive until the last collective is waited for
  std::unique_ptr<Event> done;
  for (int64_t c = 0; c < k.count; ++c) {
    Tensor& p = partial[static_cast<size_t>(c)];
    p = produce(c).contiguous();
    MC_CHECK(p.ndim() == 2 && p.size(0) == k.ranks * k.len(c) && p.size(1) == width && p.dtype() == dtype,
             "reduce_scatter_sequence_chunked: chunk ", c, " is ", p.describe(), ", expected [",
             k.ranks * k.len(c), ", ", width, "] ", dtype_name(dtype));
    const std::unique_ptr<Event> produced = record_here(dev);
    std::optional<StreamGuard> on_comm;
    if (dev.is_cuda()) {
      wait_on(produced, comm_stream_of(dev));
      on_comm.emplace(comm_stream_of(dev));
    }
    Tensor mine = out.slice(0, k.begin(c), k.end(c));
    group.reduce_scatter(p, mine, comm::ReduceOp::Sum);
    done = record_here(dev);
  }
  if (meanwhile) meanwhile();
  wait_on(done, current_stream(dev));
  return out;
}

}  // namespace moecore
