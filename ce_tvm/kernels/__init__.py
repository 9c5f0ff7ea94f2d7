"""The math, declared once and target-free (TVM TE): every kernel family's
compute, the blocks they share, the stage names schedules address, and the
vectorisable ``exp``. Knows TVM; never torch, a target or a schedule.
``kinds`` (dtypes, reductions, variants) needs no TVM at all.
"""
