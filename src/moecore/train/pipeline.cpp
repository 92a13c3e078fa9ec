#include "moecore/train/pipeline.h"

#include <deque>

#include "moecore/core/memory_categories.h"

namespace moecore {

namespace {

struct InFlight {  // a micro-batch between its forward and its backward
  GPTModel::Ctx ctx;
  Tensor output;  // hidden_out (not the last stage)
};

GPTModel::Ctx& checked(GPTModel::Ctx& ctx, const Batch& b) { return with_checked_batch(ctx, b); }

void add_loss(const PipelineStep& step, const Tensor& sum, const GPTModel::Ctx& ctx) {
  if (!sum.defined()) return;  // not the stage with the head
  MC_CHECK(step.losses, "pipeline step: the stage with the output layer needs PipelineStep::losses");
  add_micro_batch_losses(*step.losses, step.mtp_losses, sum, ctx);
}

}  // namespace

GPTModel::Ctx& with_checked_batch(GPTModel::Ctx& ctx, const Batch& b) {
  ctx.checked_num_labels = b.num_labels;
  ctx.mtp_inputs = MtpBatch{b.mtp_tokens, b.mtp_labels, b.mtp_num_labels};
  return ctx;
}

void add_micro_batch_losses(LossAccumulator& main, std::vector<LossAccumulator>* mtp, const Tensor& sum,
                            const GPTModel::Ctx& ctx) {
  if (!sum.defined()) return;
  main.add(sum, ctx.num_labels);
  if (!mtp) return;
  MC_CHECK(mtp->size() == ctx.mtp_loss_sums.size(), "training step: ", mtp->size(), " MTP loss accumulators for ",
           ctx.mtp_loss_sums.size(), " MTP depths");
  for (size_t k = 0; k < mtp->size(); ++k) (*mtp)[k].add(ctx.mtp_loss_sums[k], ctx.mtp_num_labels[k]);
}

std::vector<PipelineStage> stage_layers(int64_t num_layers, int64_t pp, int64_t vpp, int64_t first, int64_t last,
                                        int64_t pp_rank) {
  const char* kFirst = "--decoder-first-pipeline-num-layers";
  const char* kLast = "--decoder-last-pipeline-num-layers";
  MC_CHECK(pp >= 1 && vpp >= 1 && pp_rank >= 0 && pp_rank < pp, "pipeline layout: pipeline size ", pp,
           ", virtual stages ", vpp, ", rank ", pp_rank, "; expected sizes >= 1 and a rank in [0, ", pp, ")");
  MC_CHECK(num_layers >= 1, "pipeline layout: --num-layers ", num_layers, " must be >= 1");
  MC_CHECK(first >= 0 && last >= 0, kFirst, " ", first, " and ", kLast, " ", last,
           " must be >= 0 (0: not given, the stage gets the even share)");
  const bool uneven = first > 0 || last > 0;
  MC_CHECK(!uneven || pp > 1, kFirst, " / ", kLast, " need --pipeline-model-parallel-size > 1, got ", pp);
  const int64_t middle = pp - (first > 0 ? 1 : 0) - (last > 0 ? 1 : 0);
  const int64_t rest = num_layers - first - last;
  if (!uneven) {
    MC_CHECK(num_layers % pp == 0, "--num-layers ", num_layers, " is not divisible by --pipeline-model-parallel-size ",
             pp, "; expected equal stages, or uneven ones through ", kFirst, " / ", kLast);
  } else if (middle == 0) {
    MC_CHECK(rest == 0, kFirst, " ", first, " + ", kLast, " ", last, " = ", first + last, " with ", pp,
             " pipeline stages: expected them to sum to --num-layers ", num_layers);
  } else {
    MC_CHECK(rest >= middle && rest % middle == 0, "--num-layers ", num_layers, " minus ", kFirst, " ", first,
             " and ", kLast, " ", last, " leaves ", rest, " layers for the ", middle,
             " other pipeline stage(s); expected a positive multiple of ", middle, " (every stage gets the same number)");
  }
  const int64_t per_middle = middle > 0 ? rest / middle : 0;
  // Layers of each pipeline rank (over all its chunks).
  auto rank_layers = [&](int64_t r) {
    if (r == 0 && first > 0) return first;
    if (r == pp - 1 && last > 0) return last;
    return per_middle;
  };
  for (int64_t r = 0; r < pp; ++r) {
    const int64_t n = rank_layers(r);
    const char* which = r == 0 && first > 0 ? kFirst : r == pp - 1 && last > 0 ? kLast
                        : uneven                  ? "a middle stage"
                                                  : "--num-layers / --pipeline-model-parallel-size";
    MC_CHECK(n % vpp == 0, "pipeline stage ", r, " holds ", n, " layers (", which,
             "), not divisible by the ", vpp,
             " virtual stages per pipeline rank (--num-virtual-stages-per-pipeline-rank); expected a multiple of ", vpp);
  }
  std::vector<PipelineStage> out;
  for (int64_t c = 0; c < vpp; ++c) {
    int64_t begin = c * (num_layers / vpp);  // every rank's chunk c: num_layers / vpp layers in all
    for (int64_t r = 0; r < pp_rank; ++r) begin += rank_layers(r) / vpp;
    PipelineStage st;
    st.first_layer = begin;
    st.end_layer = begin + rank_layers(pp_rank) / vpp;
    st.has_embedding = c == 0 && pp_rank == 0;
    st.has_head = c == vpp - 1 && pp_rank == pp - 1;
    out.push_back(st);
  }
  return out;
}

void run_pipeline_1f1b(GPTModel& model, const PipelineStep& step) {
  comm::Communicator& pp = *step.pp;
  const int64_t stage = pp.rank(), stages = pp.size(), micro = step.micro_batches;
  const bool first = stage == 0, last = stage == stages - 1;
  const ModelConfig& cfg = model.config();
  // Shape and dtype of every transfer: the hidden states of one micro-batch.
  const Batch probe = step.batch(0);
  const Shape act_shape{model.hidden_rows(probe.tokens), cfg.hidden_size};
  const Device dev = probe.tokens.device();
  const DType act_dtype = model.compute_dtype();

  auto recv_from = [&](int peer) {
    const MemoryCategoryScope buffer(MemoryCategory::kCommunication);
    Tensor t = Tensor::empty(act_shape, act_dtype, dev);
    pp.recv(t, peer);
    return t;
  };
  // A send to one neighbour and a receive from the same neighbour, posted together so that two
  // stages exchanging in opposite directions cannot deadlock.
  auto send_recv = [&](const Tensor& out, int peer) {
    const MemoryCategoryScope buffer(MemoryCategory::kCommunication);
    Tensor in = Tensor::empty(act_shape, act_dtype, dev);
    pp.group_start();
    pp.send(out, peer);
    pp.recv(in, peer);
    pp.group_end();
    return in;
  };

  int64_t next_forward = 0, next_backward = 0;
  std::deque<InFlight> in_flight;
  auto forward = [&](const Tensor& input) {
    const int64_t m = next_forward++;
    const Batch b = m == 0 ? probe : step.batch(m);
    in_flight.emplace_back();
    InFlight& f = in_flight.back();
    f.ctx.fused_head_scale = step.grad_scale;  // the last stage runs the output layer's backward at once
    add_loss(step, model.forward_loss_sum(b.tokens, b.labels, true, step.rng(m), checked(f.ctx, b), input), f.ctx);
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
}

namespace {

Tensor hidden_like(const GPTModel& m, const Batch& b) {  // a receive buffer
  const MemoryCategoryScope buffer(MemoryCategory::kCommunication);
  return Tensor::empty({m.hidden_rows(b.tokens), m.config().hidden_size}, m.compute_dtype(), b.tokens.device());
}

}  // namespace

void run_pipeline_virtual(std::vector<GPTModel*>& chunks, const PipelineStep& step) {
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
      cx.fused_head_scale = step.grad_scale;
      add_loss(step, model.forward_loss_sum(b.tokens, b.labels, true, step.rng(m), checked(cx, b), input), cx);
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

namespace {

struct PipeOp {
  bool forward = true;
  int64_t chunk = 0, micro = 0;
  int64_t tick = -1;  // when it runs (the simulation's answer)
};

// The order of rank s's operations in Megatron's interleaved schedule.
std::vector<PipeOp> interleaved_order(int64_t s, int64_t p, int64_t v, int64_t m) {
  const int64_t total = m * v, warmup = std::min(2 * (p - s - 1) + (v - 1) * p, total);
  auto op = [&](bool forward, int64_t k) {
    const int64_t in_group = k % (p * v);
    const int64_t chunk = forward ? in_group / p : v - 1 - in_group / p;
    return PipeOp{forward, chunk, (k / (p * v)) * p + k % p, -1};
  };
  std::vector<PipeOp> ops;
  int64_t f = 0, b = 0;
  for (; f < warmup; ++f) ops.push_back(op(true, f));
  while (f < total) {
    ops.push_back(op(true, f++));
    ops.push_back(op(false, b++));
  }
  while (b < total) ops.push_back(op(false, b++));
  return ops;
}

}  // namespace

void run_pipeline_interleaved(std::vector<GPTModel*>& chunks, const PipelineStep& step) {
  comm::Communicator& pp = *step.pp;
  const int64_t me = pp.rank(), p = pp.size(), micro = step.micro_batches;
  const int64_t v = static_cast<int64_t>(chunks.size()), vstages = p * v;
  MC_CHECK(micro % p == 0, "interleaved pipeline schedule: ", micro, " micro-batches per step are not divisible by the ",
           p, " pipeline stages");
  // Every rank's operations, and when each runs.
  std::vector<std::vector<PipeOp>> ops(static_cast<size_t>(p));
  for (int64_t r = 0; r < p; ++r) ops[static_cast<size_t>(r)] = interleaved_order(r, p, v, micro);
  // done[direction][virtual stage][micro] = tick at which that F (0) or B (1) ran, -1 not yet.
  std::vector<std::vector<std::vector<int64_t>>> done(
      2, std::vector<std::vector<int64_t>>(static_cast<size_t>(vstages), std::vector<int64_t>(static_cast<size_t>(micro), -1)));
  auto vstage = [&](int64_t rank, int64_t chunk) { return chunk * p + rank; };
  std::vector<size_t> next(static_cast<size_t>(p), 0);
  int64_t ticks = 0, remaining = 2 * micro * vstages;
  while (remaining > 0) {
    MC_CHECK(ticks <= 4 * micro * vstages + 4 * p, "interleaved pipeline schedule: no progress (internal error)");
    for (int64_t r = 0; r < p; ++r) {
      size_t& i = next[static_cast<size_t>(r)];
      if (i == ops[static_cast<size_t>(r)].size()) continue;
      PipeOp& o = ops[static_cast<size_t>(r)][i];
      const int64_t vs = vstage(r, o.chunk);
      // Inputs produced at an earlier tick: the previous virtual stage's forward, or the next
      // one's backward (and this forward, earlier in the same rank's list).
      const bool free_start = o.forward && vs == 0;  // the first virtual stage reads tokens
      const int64_t needed = free_start ? 0
                             : o.forward ? done[0][static_cast<size_t>(vs - 1)][static_cast<size_t>(o.micro)]
                             : vs < vstages - 1 ? done[1][static_cast<size_t>(vs + 1)][static_cast<size_t>(o.micro)]
                                                : done[0][static_cast<size_t>(vs)][static_cast<size_t>(o.micro)];
      if (!free_start && (needed < 0 || needed >= ticks)) continue;
      o.tick = ticks;
      ++i;
      --remaining;
    }
    // Mark after the tick so that nothing produced in this tick is consumed in it.
    for (int64_t r = 0; r < p; ++r)
      for (size_t i = 0; i < next[static_cast<size_t>(r)]; ++i) {
        const PipeOp& o = ops[static_cast<size_t>(r)][i];
        if (o.tick == ticks) done[o.forward ? 0 : 1][static_cast<size_t>(vstage(r, o.chunk))][static_cast<size_t>(o.micro)] = ticks;
      }
    ++ticks;
  }

  // Run this rank's operations tick by tick with the exchanges.
  std::vector<Batch> batches;
  for (int64_t m = 0; m < micro; ++m) batches.push_back(step.batch(m));
  const GPTModel& any = *chunks[0];
  auto hidden = [&](int64_t m) {
    const Batch& b = batches[static_cast<size_t>(m)];
    const MemoryCategoryScope buffer(MemoryCategory::kCommunication);  // a receive buffer
    return Tensor::empty({any.hidden_rows(b.tokens), any.config().hidden_size}, any.compute_dtype(), b.tokens.device());
  };
  std::vector<std::vector<GPTModel::Ctx>> ctx(static_cast<size_t>(v), std::vector<GPTModel::Ctx>(static_cast<size_t>(micro)));
  // Received tensors waiting for their operation: inputs [chunk][micro], output gradients [chunk][micro].
  std::vector<std::vector<Tensor>> inputs(static_cast<size_t>(v), std::vector<Tensor>(static_cast<size_t>(micro)));
  std::vector<std::vector<Tensor>> out_grads = inputs;
  const std::vector<PipeOp>& mine = ops[static_cast<size_t>(me)];
  size_t at = 0;
  const int next_rank = static_cast<int>((me + 1) % p), prev_rank = static_cast<int>((me + p - 1) % p);
  for (int64_t t = 0; t < ticks; ++t) {
    Tensor produced;  // what this rank's operation at t sends, if anything
    bool produced_forward = true;
    if (at < mine.size() && mine[at].tick == t) {
      const PipeOp& o = mine[at++];
      const int64_t vs = vstage(me, o.chunk);
      GPTModel& model = *chunks[static_cast<size_t>(o.chunk)];
      GPTModel::Ctx& cx = ctx[static_cast<size_t>(o.chunk)][static_cast<size_t>(o.micro)];
      const Batch& b = batches[static_cast<size_t>(o.micro)];
      if (o.forward) {
        Tensor& in = inputs[static_cast<size_t>(o.chunk)][static_cast<size_t>(o.micro)];
        cx.fused_head_scale = step.grad_scale;
        add_loss(step, model.forward_loss_sum(b.tokens, b.labels, true, step.rng(o.micro), checked(cx, b), in), cx);
        in = Tensor();
        if (vs < vstages - 1) produced = cx.hidden_out;
      } else {
        Tensor& g = out_grads[static_cast<size_t>(o.chunk)][static_cast<size_t>(o.micro)];
        const bool last_one = o.micro == micro - 1;
        const Tensor d_in = model.backward(step.grad_scale, cx, last_one ? step.last_layer_done : std::function<void(int64_t)>(), g);
        g = Tensor();
        if (vs > 0) produced = d_in;
      }
      produced_forward = o.forward;
    }
    // What this rank receives at t: the previous rank's forward output for one of this rank's
    // chunks, and the next rank's input gradient.
    std::vector<std::pair<int, Tensor*>> recvs;
    std::vector<int64_t> peers = {prev_rank};
    if (next_rank != prev_rank) peers.push_back(next_rank);  // two stages: one neighbour
    for (int64_t r : peers) {
      for (const PipeOp& o : ops[static_cast<size_t>(r)]) {
        if (o.tick != t) continue;
        const int64_t vs = vstage(r, o.chunk);
        if (o.forward && r == prev_rank && vs + 1 < vstages && (vs + 1) % p == me) {
          Tensor& slot = inputs[static_cast<size_t>((vs + 1) / p)][static_cast<size_t>(o.micro)];
          slot = hidden(o.micro);
          recvs.emplace_back(prev_rank, &slot);
        }
        if (!o.forward && r == next_rank && vs > 0 && (vs - 1) % p == me) {
          Tensor& slot = out_grads[static_cast<size_t>((vs - 1) / p)][static_cast<size_t>(o.micro)];
          slot = hidden(o.micro);
          recvs.emplace_back(next_rank, &slot);
        }
      }
    }
    if (!produced.defined() && recvs.empty()) continue;
    pp.group_start();
    if (produced.defined()) pp.send(produced, produced_forward ? next_rank : prev_rank);
    for (auto& [peer, slot] : recvs) pp.recv(*slot, peer);
    pp.group_end();
  }
}

}  // namespace moecore
