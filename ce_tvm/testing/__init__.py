"""What ce_tvm is checked against, shipped for tests, benchmarks and users' own
checks (as ``torch.testing`` is for PyTorch).

- ``ce_tvm.testing.reference``: the float64 NumPy implementation of the
  contract (docs/spec.md), written from the spec alone. It imports NumPy and
  nothing of ce_tvm, so it cannot share a bug with the kernels it checks.
  Its functions take NumPy arrays (any float dtype; they compute in float64)
  and return float64 arrays: ``forward``/``backward`` (sections 1 and 2; by
  blocks of rows with ``row_terms``, ``reduce``, ``concat`` and ``totals``),
  ``prob_forward``/``prob_backward`` (probability targets, section 5),
  ``policy_outputs``/``policy_grad``/``policy_stats`` (per-token log-probs,
  entropy and their statistics, sections 6 and 9), ``capped`` and
  ``through_softcap`` (the softcap, section 5). Compare a result with it at
  the tolerance of its dtype: float32 to about 1e-5 relative, float16 and
  bfloat16 to about one unit of their last stored bit.
- ``ce_tvm.testing.pocl``: the CUDA schedule's kernels built for OpenCL and
  run on PoCL's CPU device, without a GPU (needs the ``test`` extra:
  ``pyopencl`` and ``pocl-binary-distribution``).
- ``ce_tvm.testing.gpgpu_sim``: the CUDA kernels as nvcc compiles them, run in
  GPGPU-Sim (a PTX simulator) on the CPU, functional or in its cycle model
  (the simulator is built by ``benchmarks/gpgpu_sim/build.sh``);
  ``ce_tvm.testing.gpgpu_sim_checks``: the micro-programs the patched simulator
  checks itself on.
- ``ce_tvm.testing.cuda_cases``: the cases those kernels run on either (every op family,
  dtype and vocabulary), their float64 expected outputs and the comparison
  (``benchmarks/gpu_schedule_on_pocl.py`` runs the whole matrix).
- ``ce_tvm.testing.cuda_static``: the CUDA kernels' machine code read without a
  GPU (nvcc and nvdisasm): registers, spills, instructions per element
  (``benchmarks/cuda_static.py`` prints them).

Importing ``ce_tvm.testing`` imports none of them. Its modules import NumPy,
torch, TVM and ce_tvm's lower layers (kernels, schedules, store, compiler,
runtime), never the torch surface at ce_tvm's top level: a check does not go
through what it checks. Nothing here runs when the loss runs.
"""
