"""benchmarks/cpu_levers.py: each lever of the CPU schedule switched off really
changes the kernel (on this host and in AVX-512 code), and only its speed: the
outputs stay bit for bit those of the hand schedule, or within a rounding where
the lever reorders the arithmetic."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ce_tvm.schedules import cpu
from ce_tvm.schedules.cpu_narrowing import has_bf16_rounding
from ce_tvm.schedules.cpu_widening import has_word_permutes
from ce_tvm.store import targets

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "cpu_levers.py"
LEVERS = ["chunk_in_place", "logits_sum_in_max_loop", "sum_with_max", "one_hot_by_chunk",
          "last_chunk_peeled", "prefetch_next_chunk", "prefetchw_gradient",
          "compared_ramps_as_offsets", "bf16_rounding_once", "vcvtneps2bf16", "vcvtne2ps2bf16",
          "vpermt2w", "sums_ride_the_exp", "smoothing_left_out", "row_shift",
          "train_chunk_in_l1", "hand_knobs", "streamed_gradient", "tree_lane_reductions",
          "tree_lane_reductions_eps0", "next_row_prefetch", "row_shift_smoothing",
          "next_row_prefetch_smoothing", "staged_gradient", "pairs_widening", "lagged_rows"]
# Levers of AVX-512 kernels alone. Rows of 4099 float32 classes are not 64-byte
# multiples: there their gradient is streamed by blocks through a scratch buffer
# (staged_gradient), the next row prefetched with it.
AVX512_ONLY = {"row_shift", "row_shift_smoothing", "next_row_prefetch",
               "next_row_prefetch_smoothing", "staged_gradient", "lagged_rows"}
# Levers that change the arithmetic's order: other accumulators (the sums), the
# one-hot term subtracted by chunk (LLVM contracts it into another FMA), other
# chunks (the row's max and sums merged in another order), the exp-sum taken
# against the row's shift rather than each chunk's max (with the forward's
# kernel without label smoothing, or with it; a staged chunk takes no shift),
# a sum's vector accumulators merged by halves, a row's elements summed in pair
# order (the bf16 log-probs' sums take it where they ride the kept exp's loop),
# the gradient's loops moved into the next row's (LLVM contracts a multiply and
# a subtraction otherwise: one bf16 rounding in some elements).
REASSOCIATING = ("hand_knobs", "one_hot_by_chunk", "train_chunk_in_l1", "row_shift",
                 "row_shift_smoothing", "chunk_in_place", "smoothing_left_out",
                 "tree_lane_reductions", "tree_lane_reductions_eps0", "pairs_widening",
                 "sums_ride_the_exp", "lagged_rows")


def _levers(tmp_path, *extra) -> list:
    out = tmp_path / "levers.json"
    done = subprocess.run([sys.executable, SCRIPT, "--shapes", "64x4099", "--reps", "1",
                           "--json", out, *extra], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(out.read_text())["records"]


@pytest.mark.slow  # a process building 40 kernels
def test_every_lever_changes_the_host_kernel_and_not_its_outputs(tmp_path):
    records = _levers(tmp_path)
    timed = [r for r in records if r["effect"] == "timed"]
    host = targets.tvm_target("llvm")
    missing = ({"vcvtneps2bf16", "vcvtne2ps2bf16"} if not has_bf16_rounding(host) else set()) \
        | ({"vpermt2w"} if not has_word_permutes(host) else set()) \
        | ({"sums_ride_the_exp"} if not cpu.sums_ride_the_exp(host) else set()) \
        | (AVX512_ONLY if not cpu.shifts_rows(host) else set()) \
        | ({"train_chunk_in_l1"} if all(cpu.train_chunk(4099, dtype, host) == cpu.forward_chunk(
            4099, dtype, host) for dtype in ("float32", "bfloat16")) else set())
    assert {r["lever"] for r in timed} == set(LEVERS) - missing
    for r in timed:
        assert r["hand_ms"] > 0 and r["without_ms"] > 0
        hand, without = r["insn_per_element"]
        assert 0 < hand < 20 and 0 < without < 20
        if r["lever"] in REASSOCIATING:
            assert r["outputs"] == "identical" or float(r["outputs"].split()[-1]) < 1e-5
        else:
            assert r["outputs"] == "identical", r


@pytest.mark.slow
def test_every_lever_changes_the_avx512_kernel(tmp_path):
    """Built for Zen 5 (AVX-512 with BF16) and counted, not run."""
    records = _levers(tmp_path, "--target", "llvm -mcpu=znver5")
    # with Zen 5's 48 KB of L1d the training chunk at C = 4099 is the forward's
    same = {"train_chunk_in_l1"}
    assert {r["lever"] for r in records if r["effect"] == "counted"} == set(LEVERS) - same
    assert {r["lever"] for r in records if r["effect"] == "same assembly"} == same
    assert not [r for r in records if r["effect"] == "timed"]
