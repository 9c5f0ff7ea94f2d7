"""Schedule steps every target needs, whatever its layout (not a target itself)."""

from __future__ import annotations

ROW_TOTALS = ("ce_total_ce", "ce_total_z", "ce_total_weight", "ce_total_count")


def existing_blocks(sch, names):
    """The blocks among ``names`` that this variant of the compute has."""
    out = []
    for name in names:
        try:
            out.append(sch.get_sblock(name))
        except Exception:  # noqa: BLE001 - TVM raises a bare error for a missing block
            continue
    return out


def init_row_totals(sch) -> None:
    """Hoist the init of the serial sums over rows out of their loop.

    Lowered as-is, a reduction initialises on its first iteration, which an
    empty batch (N = 0) never runs: the sum would be left uninitialised.
    """
    for block in existing_blocks(sch, ROW_TOTALS):
        sch.decompose_reduction(block, sch.get_loops(block)[-1])
