// `moecore eval`: the loss and perplexity of a checkpoint on a dataset, without training. It
// takes the train flags (apps/train_command.cpp): the model's come from --load, and so do the
// settings that pick the validation samples (--seed, --split, --micro-batch-size, --eval-iters)
// and the precision (--bf16, --moe-router-dtype) unless given, so that by default it reads the
// samples a training run's validation read and reproduces its logged validation loss. Any
// parallel layout the trainer runs works (the same TrainingRun); the logging rank prints one line
// and then the JSON last line {"lm_loss": ..., "ppl": ..., "samples": ...}.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iostream>

#include <nlohmann/json.hpp>

#include "commands.h"
#include "moecore/comm/bootstrap.h"
#include "moecore/train/checkpoint.h"
#include "moecore/train/evaluate.h"
#include "moecore/train/train_setup.h"
#include "train_command.h"

namespace moecore {

int run_eval(const std::vector<std::string>& argv) {
  bool whole = false;
  TrainFlagsUse use;
  use.command = "moecore eval";
  use.summary = "Loss and perplexity of a checkpoint (--load) on the validation split of --data-path (the train "
                "flags; the model's and the validation settings come from the checkpoint unless given).";
  use.extra_flags = [&](cli::FlagSet& f) {
    f.add_bool("whole-dataset", &whole, "every sample of one epoch of the validation split instead of --eval-iters "
                                        "micro-batches");
  };
  use.defaults = {{"train-iters", "1"}, {"eval-interval", "1"}};
  use.also_from_checkpoint = {"seed", "split", "micro-batch-size", "eval-iters", "bf16", "moe-router-dtype"};
  use.before_finalize = [](TrainArgs& a) {
    MC_CHECK(!a.load.empty(), "moecore eval needs --load <checkpoint directory>");
    MC_CHECK(checkpoint_exists(a.load), "moecore eval: no checkpoint in --load ", a.load,
             " (expected a save directory or an iter_* directory with meta.json)");
    MC_CHECK(a.save.empty(), "moecore eval writes no checkpoint: drop --save");
    a.eval_only = true;
    // Every data-parallel rank reads the same batches: one micro-batch per rank and step.
    const comm::LaunchEnv env = comm::read_launch_env();
    const int64_t model_ranks = std::max<int64_t>(1, a.tp * a.cp * a.pp);
    a.global_batch_size = a.micro_batch_size * std::max<int64_t>(1, env.world / model_ranks);
  };
  bool help = false;
  std::string help_text;
  const TrainArgs args = parse_train_args(argv, &help, &help_text, use);
  if (help) {
    std::cout << help_text;
    return 0;
  }
  TrainingRun run(args);  // communicators, model, --load (weights only), data
  double loss = 0;
  int64_t samples = 0;
  if (whole) {
    const SplitSamples split = make_whole_split_source(args, Split::Valid);
    samples = split.samples;
    loss = evaluate_samples(run, *split.source, samples);
  } else {
    MC_CHECK(run.data.valid != nullptr, "moecore eval: the validation split of --split ", args.split,
             " is empty; give a --split with a validation weight (e.g. 0,1,0 for the whole dataset)");
    samples = args.eval_iters * args.micro_batch_size;
    loss = evaluate(run);
  }
  if (run.logger) {
    const double ppl = std::exp(std::min(loss, 700.0));
    std::printf("moecore eval: %s on %lld validation samples of %lld tokens | lm loss: %.6E | lm loss PPL: %.6E\n",
                args.load.c_str(), static_cast<long long>(samples), static_cast<long long>(args.model.seq_length),
                loss, ppl);
    std::printf("%s\n", nlohmann::json({{"lm_loss", loss}, {"ppl", ppl}, {"samples", samples}}).dump().c_str());
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace moecore
