# moecore: the commands every issue, CI and the README use.
#   make build      install dependencies (Debian/Ubuntu, idempotent), configure, build
#   make test       build, then the CPU test tiers (ctest labels unit and dist)
#   make demo       build, then the default demo
#   make gpu-test   CUDA build, then the gpu tier; one summary line last
#   make gpu-dist   2+ GPUs: NCCL tests, DP/EP equivalence on GPUs, multi-GPU throughput table
#   make gpu-scaling 4 or 8 GPUs: the scaling table (EP, EDP, DP, folded TP/EP, PP=4 interleaved)
#   make bench      build, then the benchmarks (JSON lines and a table each)
# BUILD_DIR (default build), JOBS (default: cores), CMAKE_ARGS pass through.
BUILD_DIR ?= build
JOBS ?= $(shell nproc)
CMAKE_ARGS ?=

.PHONY: build deps configure test demo gpu-test gpu-dist gpu-scaling bench clean

deps:
	@scripts/install-deps.sh

configure: deps
	@cmake -S . -B $(BUILD_DIR) -DCMAKE_BUILD_TYPE=Release $(CMAKE_ARGS) >/dev/null

build: configure
	@cmake --build $(BUILD_DIR) -j $(JOBS)

test: build
	@cd $(BUILD_DIR) && ctest -L 'unit|dist' -j $(JOBS) --output-on-failure --timeout 300

demo: build
	@scripts/demo.sh $(BUILD_DIR)

gpu-test:
	@scripts/gpu-test.sh $(BUILD_DIR)

gpu-dist:
	@scripts/gpu-dist.sh $(BUILD_DIR)

gpu-scaling:
	@scripts/gpu-scaling.sh $(BUILD_DIR)

bench: build
	@scripts/bench.sh $(BUILD_DIR)

clean:
	rm -rf $(BUILD_DIR)
