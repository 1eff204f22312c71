#!/usr/bin/env bash
# GPU readiness check (about 5 minutes): the cache-on-GPU, storage-in-host-memory path, never run before.
# Usage, from the repository root on a machine with an NVIDIA GPU and a CUDA build of torch:
#   tools/gpu_check.sh [OUT_DIR]        (through the `device` tool: tools/gpu_check.sh "$OUT")
# Writes OUT_DIR/gpu_check.log: the device, the CUDA tests, and a short timing of a training step with the
# cache on the GPU against everything on the CPU, with and without prefetch. Exits non-zero if a test fails.
set -u
OUT=${1:-gpu_check_out}
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 || echo "nvidia-smi not found"
  "$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())' \
    || { echo "no torch for $PY: set PYTHON to an interpreter with a CUDA build of torch"; exit 2; }
  "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 3)' || { echo "CUDA is not available"; exit 3; }
  echo "== CUDA tests (tests/embedding/test_gpu.py) + the embedding and lookahead tests on this machine"
  timeout 180 "$PY" -m pytest -q -x -p no:cacheprovider tests/embedding/test_gpu.py tests/embedding/test_lookahead.py tests/embedding/test_embedding.py
  status=$?
  echo "== timing: INT8 storage in host memory, 5% cache, dim 64, batch 2048, 26 tables x 200k rows, Zipf 1.05"
  timeout 120 "$PY" - <<'PYEOF'
import time, torch
from slipcache.embedding.collection import CachedEmbeddingBagCollection, EmbeddingConfig
from slipcache.bench.workload import make_workload

work = make_workload([200_000] * 26, batch_size=2048, warmup_steps=0, timed_steps=120, seed=0)
grad64 = torch.randn(2048, 26, 64) * 0.01
for name, device, prefetch in (("cpu", "cpu", False), ("gpu cache", "cuda", False), ("gpu cache + prefetch", "cuda", True)):
    coll = CachedEmbeddingBagCollection(EmbeddingConfig(work.table_sizes, dim=64, precision="int8", cache_size=0.05,
                                                        cache_device=device, storage_device="cpu"))
    batches = [b.to(device) for b in work.batches]
    grad = grad64.to(device)
    def run(steps, first):
        for i in range(first, first + steps):
            if prefetch:
                coll.set_lookahead(batches[i + 1 : i + 2], prefetch=True)
            coll(batches[i]).backward(grad)
    run(60, 0)  # warm-up: fills the cache
    coll.reset_stats()
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    run(59, 60)
    if device == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    stats = coll.stats()
    print(f"{name:22s} {59 * 2048 / elapsed:12,.0f} samples/s  hit rate {stats['hit_rate']:.3f}  "
          f"prefetched rows {stats['prefetched_rows']}")
PYEOF
  date -u
  exit $status
} 2>&1 | tee "$LOG"
exit "${PIPESTATUS[0]}"
