"""The compiler side: a spec's compute + its target's schedule (+ a tuning
record) -> ``tvm.compile`` -> a shared library (and a cubin for CUDA).
Imported only when a module must be built; never torch, never the runtime.
"""
