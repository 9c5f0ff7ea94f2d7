"""What users run beside the loss: the ``ce-tvm`` command line, the demo,
benchmarks, peak-memory probes, the tuning search and bundles. Sits on
everything below; nothing in ce_tvm imports it.
"""
