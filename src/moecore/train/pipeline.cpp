#include "moecore/train/pipeline.h"

#include <deque>

namespace moecore {

namespace {

struct InFlight {  // a micro-batch between its forward and its backward
  GPTModel::Ctx ctx;
  Tensor output;  // hidden_out (not the last stage)
};

}  // namespace

double run_pipeline_1f1b(GPTModel& model, const PipelineStep& step) {
  comm::Communicator& pp = *step.pp;
  const int64_t stage = pp.rank(), stages = pp.size(), micro = step.micro_batches;
  const bool first = stage == 0, last = stage == stages - 1;
  const ModelConfig& cfg = model.config();
  // Shape and dtype of every transfer: the hidden states of one micro-batch.
  const Batch probe = step.batch(0);
  const Shape act_shape{probe.tokens.numel(), cfg.hidden_size};
  const Device dev = probe.tokens.device();
  const DType act_dtype = model.compute_dtype();

  auto recv_from = [&](int peer) {
    Tensor t = Tensor::empty(act_shape, act_dtype, dev);
    pp.recv(t, peer);
    return t;
  };
  // A send to one neighbour and a receive from the same neighbour, posted together so that two
  // stages exchanging in opposite directions cannot deadlock.
  auto send_recv = [&](const Tensor& out, int peer) {
    Tensor in = Tensor::empty(act_shape, act_dtype, dev);
    pp.group_start();
    pp.send(out, peer);
    pp.recv(in, peer);
    pp.group_end();
    return in;
  };

  double loss_sum = 0;
  int64_t next_forward = 0, next_backward = 0;
  std::deque<InFlight> in_flight;
  auto forward = [&](const Tensor& input) {
    const int64_t m = next_forward++;
    const Batch b = m == 0 ? probe : step.batch(m);
    in_flight.emplace_back();
    InFlight& f = in_flight.back();
    loss_sum += model.forward(b.tokens, b.labels, true, step.rng(m), f.ctx, input);
    f.output = f.ctx.hidden_out;
  };
  auto backward = [&](const Tensor& d_output) {
    const int64_t m = next_backward++;
    InFlight f = std::move(in_flight.front());
    in_flight.pop_front();
    const bool last_one = m == micro - 1;
    return model.backward(step.grad_scale, f.ctx, last_one ? step.last_layer_done : std::function<void(int64_t)>(),
                          d_output);
  };

  const int64_t warmup = std::min(stages - stage - 1, micro), steady = micro - warmup;
  for (int64_t i = 0; i < warmup; ++i) {
    forward(first ? Tensor() : recv_from(stage - 1));
    if (!last) pp.send(in_flight.back().output, stage + 1);
  }
  Tensor input = steady > 0 && !first ? recv_from(stage - 1) : Tensor();
  for (int64_t i = 0; i < steady; ++i) {
    forward(input);
    const Tensor d_output = last ? Tensor() : send_recv(in_flight.back().output, stage + 1);
    const Tensor d_input = backward(d_output);
    if (i == steady - 1) {
      if (!first) pp.send(d_input, stage - 1);
    } else {
      input = first ? Tensor() : send_recv(d_input, stage - 1);
    }
  }
  for (int64_t i = 0; i < warmup; ++i) {
    const Tensor d_output = last ? Tensor() : recv_from(stage + 1);
    const Tensor d_input = backward(d_output);
    if (!first) pp.send(d_input, stage - 1);
  }
  return loss_sum;
}

namespace {

Tensor hidden_like(const GPTModel& m, const Batch& b) {
  return Tensor::empty({b.tokens.numel(), m.config().hidden_size}, m.compute_dtype(), b.tokens.device());
}

}  // namespace

double run_pipeline_virtual(std::vector<GPTModel*>& chunks, const PipelineStep& step) {
  comm::Communicator& pp = *step.pp;
  const int64_t rank = pp.rank(), ranks = pp.size(), micro = step.micro_batches;
  const int64_t v = static_cast<int64_t>(chunks.size());
  const int next = static_cast<int>((rank + 1) % ranks), prev = static_cast<int>((rank + ranks - 1) % ranks);
  const bool first_rank = rank == 0, last_rank = rank == ranks - 1;
  std::vector<Batch> batches;
  for (int64_t m = 0; m < micro; ++m) batches.push_back(step.batch(m));
  std::vector<std::vector<GPTModel::Ctx>> ctx(static_cast<size_t>(v), std::vector<GPTModel::Ctx>(static_cast<size_t>(micro)));
  std::vector<Tensor> wrap(static_cast<size_t>(micro));  // outputs (or gradients) crossing from the last rank to rank 0
  auto exchange_wrap = [&](bool forward) {
    // forward: the last rank's outputs to rank 0; backward: rank 0's input gradients to the last rank.
    const bool sender = forward ? last_rank : first_rank, receiver = forward ? first_rank : last_rank;
    pp.group_start();
    for (int64_t m = 0; m < micro; ++m) {
      if (sender) pp.send(wrap[static_cast<size_t>(m)], forward ? next : prev);
      if (receiver) {
        Tensor in = hidden_like(*chunks[0], batches[static_cast<size_t>(m)]);
        pp.recv(in, forward ? prev : next);
        wrap[static_cast<size_t>(m)] = in;
      }
    }
    pp.group_end();
  };

  double loss_sum = 0;
  for (int64_t c = 0; c < v; ++c) {
    GPTModel& model = *chunks[static_cast<size_t>(c)];
    const bool first_vstage = first_rank && c == 0, last_vstage = last_rank && c == v - 1;
    if (c > 0 && ranks > 1) exchange_wrap(true);
    for (int64_t m = 0; m < micro; ++m) {
      const Batch& b = batches[static_cast<size_t>(m)];
      Tensor input;
      if (!first_vstage) {
        if (first_rank) {
          input = wrap[static_cast<size_t>(m)];
        } else {
          input = hidden_like(model, b);
          pp.recv(input, prev);
        }
      }
      GPTModel::Ctx& cx = ctx[static_cast<size_t>(c)][static_cast<size_t>(m)];
      loss_sum += model.forward(b.tokens, b.labels, true, step.rng(m), cx, input);
      if (last_vstage) continue;
      if (last_rank) {
        wrap[static_cast<size_t>(m)] = cx.hidden_out;
      } else {
        pp.send(cx.hidden_out, next);
      }
    }
  }
  for (int64_t c = v - 1; c >= 0; --c) {
    GPTModel& model = *chunks[static_cast<size_t>(c)];
    const bool first_vstage = first_rank && c == 0, last_vstage = last_rank && c == v - 1;
    if (c < v - 1 && ranks > 1) exchange_wrap(false);
    for (int64_t m = 0; m < micro; ++m) {
      const Batch& b = batches[static_cast<size_t>(m)];
      Tensor d_output;
      if (!last_vstage) {
        if (last_rank) {
          d_output = wrap[static_cast<size_t>(m)];
        } else {
          d_output = hidden_like(model, b);
          pp.recv(d_output, next);
        }
      }
      const bool last_one = m == micro - 1;
      const Tensor d_input = model.backward(step.grad_scale, ctx[static_cast<size_t>(c)][static_cast<size_t>(m)],
                                            last_one ? step.last_layer_done : std::function<void(int64_t)>(), d_output);
      if (first_vstage) continue;
      if (first_rank) {
        wrap[static_cast<size_t>(m)] = d_input;
      } else {
        pp.send(d_input, prev);
      }
    }
  }
  return loss_sum;
}

double pipeline_forward_only(std::vector<GPTModel*>& chunks, comm::Communicator& pp, const Batch& b) {
  const int64_t rank = pp.rank(), ranks = pp.size(), v = static_cast<int64_t>(chunks.size());
  const int next = static_cast<int>((rank + 1) % ranks), prev = static_cast<int>((rank + ranks - 1) % ranks);
  double loss = 0;
  for (int64_t c = 0; c < v; ++c) {
    GPTModel& model = *chunks[static_cast<size_t>(c)];
    const bool first_vstage = rank == 0 && c == 0, last_vstage = rank == ranks - 1 && c == v - 1;
    Tensor input;
    if (!first_vstage) {
      input = hidden_like(model, b);
      pp.recv(input, prev);
    }
    GPTModel::Ctx cx;
    loss += model.forward(b.tokens, b.labels, false, 0, cx, input);
    if (!last_vstage) pp.send(cx.hidden_out, next);
  }
  return loss;
}

}  // namespace moecore
