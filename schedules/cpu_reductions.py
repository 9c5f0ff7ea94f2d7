"""Vector accumulators reduced to one value by halves (a tree), not lane by lane.

A row reduction is split by the vector width and rfactored
(``_common.split_reduction``): its partial results are a vector of ``L``
lanes (two native vectors), and the block that merges them lowers to a
serial loop, ``acc = op(acc, rf[j])`` for ``j`` in ``0 .. L-1``. LLVM keeps
that order (float addition is not associative), so each merge is ``L``
scalar operations in one dependency chain: on AVX-512 31 shuffles and 32
``vaddss``/``vmaxss`` per merge, and the chunk's ``exp`` loop waits for its
max's chain. The training kernel's chunk loop spent about 0.23 instructions
per element of a row there (363 per 1600-class chunk, Zen 4).

``tree_lane_reductions`` (a pass after lowering) rewrites such a loop (one
merge, or several side by side, each into its own value: the log-probs' two
sums), when ``L`` is a power of two and ``op`` is a sum, max or min, as ``log2(L)``
vector steps: the upper half of the lanes combined with the lower half, until
one lane is left, then combined with the reduction's initial value. A max or
min is the same value; a sum is the same terms added in another order (as the
vector accumulators already do along the row).
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import tirx

from ._common import collect_nodes, depends_on, statements

_OPS = (tirx.Add, tirx.Max, tirx.Min)
_LOAD = tvm.ir.expr.TensorLoad  # what tirx.BufferLoad makes


def _is_first(cond, j) -> bool:
    return (isinstance(cond, tirx.EQ) and cond.a.same_as(j)
            and isinstance(cond.b, tirx.IntImm) and cond.b.value == 0)


def _merges(body, j) -> list | None:
    """``[(init store or None, update store)]`` of a lane loop's body (one merge,
    or several side by side, each into its own buffer), else None."""
    stmts = statements(body)
    merges, init = [], None
    for stmt in stmts:
        if (init is None and isinstance(stmt, tirx.IfThenElse) and stmt.else_case is None
                and _is_first(stmt.condition, j) and isinstance(stmt.then_case, tirx.BufferStore)):
            init = stmt.then_case
        elif isinstance(stmt, tirx.BufferStore) and (init is None
                                                      or init.buffer.same_as(stmt.buffer)):
            merges.append((init, stmt))
            init = None
        else:
            return None
    written = [update.buffer for _, update in merges]
    if init is not None or any(a.same_as(b) for i, a in enumerate(written) for b in written[:i]):
        return None
    return merges


def _lane_base(index, j):
    """``b`` when ``index`` is ``j`` or ``b + j`` (``b`` free of ``j``), else None."""
    if index.same_as(j):
        return tirx.const(0, str(j.ty))
    if isinstance(index, tirx.Add) and index.b.same_as(j) and not depends_on(index.a, j):
        return index.a
    return None


def _same_element(load, store) -> bool:
    return (isinstance(load, _LOAD) and load.source.same_as(store.buffer)
            and len(load.indices) == len(store.indices)
            and all(tvm_ffi.structural_equal(a, b) for a, b in zip(load.indices, store.indices)))


def _halves(vector, lanes: int, op):
    """``op`` of the lanes of ``vector`` (``lanes`` a power of two), by halves."""
    while lanes > 1:
        half = lanes // 2
        var = tirx.Var("lanes", vector.ty)
        vector = tirx.Let(var, vector, op(tirx.Shuffle([var], list(range(half))),
                                          tirx.Shuffle([var], list(range(half, lanes)))))
        lanes = half
    return vector


def _merged_by_halves(init, update, j, lanes: int, written: list):
    """The store of one merge as a tree of halves, or None if it is not one."""
    value = update.value
    if (type(value) not in _OPS or tvm.runtime.DataType(str(value.ty)).lanes != 1
            or any(depends_on(i, j) for i in update.indices)):
        return None
    acc, lane = (value.a, value.b) if _same_element(value.a, update) else (value.b, value.a)
    if (not _same_element(acc, update) or not isinstance(lane, _LOAD)
            or len(lane.indices) != 1 or any(lane.source.same_as(b) for b in written)):
        return None
    base = _lane_base(lane.indices[0], j)
    if base is None or (init is not None and (depends_on(init.value, j) or any(
            load.source.same_as(b) for load in collect_nodes(init.value, _LOAD)
            for b in written))):
        return None
    vector = tirx.BufferLoad(lane.source, [tirx.Ramp(base, tirx.const(1, str(base.ty)), lanes)])
    start = init.value if init is not None else acc
    op = type(value)
    return tirx.BufferStore(update.buffer, op(start, _halves(vector, lanes, op)),
                            update.indices)


def _as_tree(loop):
    """``loop`` rewritten as trees of halves when it merges vector accumulators."""
    extent = loop.extent
    if (loop.kind != tirx.ForKind.SERIAL or not isinstance(loop.min, tirx.IntImm)
            or loop.min.value != 0 or not isinstance(extent, tirx.IntImm)
            or extent.value < 2 or extent.value & (extent.value - 1)):
        return loop
    merges = _merges(loop.body, loop.loop_var)
    if not merges:
        return loop
    written = [update.buffer for _, update in merges]
    trees = [_merged_by_halves(init, update, loop.loop_var, extent.value, written)
             for init, update in merges]
    if any(tree is None for tree in trees):
        return loop
    return trees[0] if len(trees) == 1 else tirx.SeqStmt(trees)


@tvm.tirx.transform.prim_func_pass(opt_level=0)
def tree_lane_reductions(func, mod, ctx):
    """Each lane reduction's serial loop as a tree of halves (module docstring)."""
    return func.with_body(tvm_ffi.structural_map(func.body, [(tirx.For, _as_tree)],
                                                 order="post"))
