#!/usr/bin/env bash
# The GPU check (issue 37, item 8): the CUDA tests (tests/test_cuda.py: the language model's equality tests on the
# GPU, training, generating and serving there), then the generation race with every contender on the GPU
# (benchmarks/generate_race.py --device cuda, written to benchmarks/results/generate-race-gpu.json); with
# NANOGPT naming a nanoGPT checkout, training tokens/s against it on the GPU too (benchmarks/lm.py --device cuda,
# written to benchmarks/results/lm-gpu.json).
#
#   bash benchmarks/gpu.sh OUT_DIR                          # from the repository root, ../shared/data beside it
#   NANOGPT=/path/to/nanoGPT bash benchmarks/gpu.sh OUT_DIR
#
# Needs a python3 whose torch sees a CUDA GPU, with attnkit's dependencies and transformers (pip install -e
# '.[dev]' with a CUDA build of torch). Logs and the race's JSON are copied to OUT_DIR. Exits non-zero when a
# test or the race failed.
set -uo pipefail
out=${1:?usage: bash benchmarks/gpu.sh OUT_DIR}
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 | tee "$out/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, \
torch.cuda.get_device_name())" 2>&1 | tee -a "$out/gpu.txt"
python3 -m pytest -q -p no:warnings -rs tests/test_cuda.py 2>&1 | tee "$out/pytest-cuda.log"
tests=${PIPESTATUS[0]}
python3 benchmarks/generate_race.py --device cuda --threads 1 --repeats 3 2>&1 | tee "$out/race.log"
race=${PIPESTATUS[0]}
cp benchmarks/results/generate-race-gpu.json "$out/" 2>/dev/null
train=0
if [ -n "${NANOGPT:-}" ]; then
  python3 benchmarks/lm.py --nanogpt "$NANOGPT" --rows throughput --device cuda --work "$out/lm" 2>&1 | tee "$out/lm.log"
  train=${PIPESTATUS[0]}
  cp benchmarks/results/lm-gpu.json "$out/" 2>/dev/null
fi
echo "tests exit $tests, race exit $race, training throughput exit $train"
exit $(( tests != 0 || race != 0 || train != 0 ))
