"""Static evidence for the CPU kernels, from their assembly (nothing runs).

For one shape (op, dtype, C, CPU target such as ``llvm -mcpu=znver5``) this
builds the kernel exactly as the runtime builds it (``build.lower_and_compile``
of a ``KernelSpec``, the hand schedule of ``schedules/cpu.py``), with the
target's ``mcpu`` in place of this host's CPU: LLVM only emits assembly, so an
AVX-512 target (``znver5``) is analysed on an AVX2 machine and the host does
not matter. The assembly is TVM's ``Module.inspect_source("asm")`` (AT&T
syntax). Per element loop it reports x86 instructions per element and their
split by what they do.

Method:

1. Loops, per function (TVM outlines the parallel row loop into
   ``__tvm_parallel_lambda``): the basic blocks and their edges, dominators,
   and a natural loop per back edge (a jump to a block that dominates it;
   back edges to one header are one loop). Each loop is counted on its *own*
   instructions: its blocks less those of the loops nested in it (static
   count of one iteration, every path of its body included).
2. A memory access is *streaming* when its base or index register is
   written in the loop (the array walks with the loop); RIP-relative
   constants and stack slots (spills) are not. An innermost loop with a
   streaming access is an *element loop*. Elements per iteration: for each
   stream (loads or stores through one base and index register) the lanes its
   distinct accesses move, the largest of the streams. Lanes come from the
   instruction: ``ps``/``ss`` forms and ``vmovups`` 4-byte lanes of the vector
   register (zmm 64 B, ymm 32 B, xmm 16 B), the bf16/f16 widening loads
   (``vpmovzxwd``, ``vcvtph2ps``) and narrowing stores (``vcvtneps2bf16``,
   ``vpmovdw``) a 32-bit lane per 16-bit element, integer moves
   (``vmovdqu``) lanes of the storage dtype. A staged float32 chunk of a bf16
   row therefore counts its float32 lanes, not bytes over the storage size.
3. Instructions per element of an element loop = its own instructions /
   elements per iteration. An outer loop (a chunk or row loop) adds its own
   instructions (the chunk's horizontal reductions, its rescaling) over the
   elements one of its iterations covers: the largest over its nested loops
   of their elements per iteration times their trip count, read off the
   induction variable (``xor``/``mov $init``, ``add $step``, ``cmp $end``).
4. A kernel's instructions per element: each loop's, times the share of a
   row's C elements it runs (its elements per iteration times its trip count
   and those of the loops around it inside the row loop, over C; 1 where a
   trip count is not found): a last chunk peeled into a loop of its own
   counts for its chunk only. Alternatives (loops that neither reach the
   other within one iteration of the loop around them: the training gradient
   of the chunk holding the row's label and of the other chunks) charge their
   costliest. Only the row function's loops count (the one whose loop covers
   the most elements: TVM's parallel row lambda).
5. Categories, per instruction of an element loop, from the data flow in
   its body (first match wins): ``store`` a streaming store; ``load`` a
   streaming load that only moves or widens, and the widening after it
   (``vpslld $16``, ``vpunpck*wd``, the mask ``vpand`` of a bf16 pair's
   high word) of loaded values; ``narrow`` integer
   vector work whose results only reach stores (bf16 rounding and packing:
   ``vpsrld``/``vpaddd``/``vpmovdw``/``vpackusdw``/``vcvtne[2]ps2bf16``, and the
   ``vinsert*`` joining narrowed halves);
   ``max`` a ``vmax`` into a loop-carried accumulator; ``sum`` an add or FMA
   into a loop-carried accumulator (a load folded into it counts here); ``exp``
   what an ``exp`` result is computed from (``vscalefps``, or the product with
   the ``vpslld $23`` power of two): its argument ``x - max``, the clamp, the
   polynomial and its register copies; ``grad`` the remaining vector
   arithmetic of a loop that stores (the gradient's scale and one-hot
   subtraction, the log-prob's ``x - lse``); ``other`` the rest (loop
   control, address arithmetic, prefetches, spills, constants).

``benchmarks/cpu_static.py`` prints the table; ``tests/schedules/test_cpu_static.py``
checks the method and that an AVX2 target's code holds no AVX-512.
"""

from __future__ import annotations

import contextlib
import functools
import math
import re
from dataclasses import dataclass, field

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
CATEGORIES = ("load", "max", "exp", "sum", "grad", "narrow", "store", "other")
OPS = {  # tool op -> (KernelSpec op, Variant keywords); -ns: without label smoothing (eps = 0)
    "train": ("train", {"log_prob": False}),
    "train-ns": ("train", {"log_prob": False, "smoothing": False}),
    "forward": ("forward", {"log_prob": False}),
    "forward-ns": ("forward", {"log_prob": False, "smoothing": False}),
    "forward-lp": ("forward", {"log_prob": True}),
    "backward": ("backward", {"grad_source": "logits"}),
    "log_probs": ("log_probs", {"columns": 1}),
    "log_probs-nh": ("log_probs", {"columns": 1, "entropy": False}),  # no entropy
    "log_probs_grad": ("log_probs_grad", {"columns": 1}),
}

_VREG = re.compile(r"%([xyz])mm(\d+)")
_GPR = {}
for _n in "abcd":
    for _form in (f"r{_n}x", f"e{_n}x", f"{_n}x", f"{_n}l", f"{_n}h"):
        _GPR[_form] = f"r{_n}x"
for _n in ("si", "di", "bp", "sp"):
    for _form in (f"r{_n}", f"e{_n}", _n, f"{_n}l"):
        _GPR[_form] = f"r{_n}"
for _i in range(8, 16):
    for _suffix in ("", "d", "w", "b"):
        _GPR[f"r{_i}{_suffix}"] = f"r{_i}"
_WIDTH = {"x": 16, "y": 32, "z": 64}
_NO_DEST = re.compile(r"^(cmp|test|v?u?comis|vptest|bt|j|prefetch|push|call|ret|nop|vzeroupper"
                      r"|ud2)")
_MOVE = re.compile(r"^(v?mov|vbroadcast|vpbroadcast|lea|vpmovzx|vpmovsx|vcvt|cvt|set|pop"
                   r"|vpmov[a-z]*[dq][wb]|vextract|vpextr|vinsert|vperm|vpshuf|vshuf|vpinsr"
                   r"|vpunpck|vunpck)")
_LEGACY_RMW = re.compile(r"^(add|sub|inc|dec|neg|not|and|or|xor|shl|shr|sar|imul|adc|sbb|rol|ror)")
_WIDEN = re.compile(r"^(vpslld|vpunpck[lh]wd|vpmovzxwd|vpmovsxwd|vcvtph2ps|vinserti|vpermq"
                    r"|vperm2i128|vpblendw|vperm[ti]2w|vpand[dq]?$)")
_NARROWING = re.compile(r"^(vcvtne2?ps2bf16|vpmov[us]?dw|vpackusdw|vpackssdw)")


@dataclass
class Insn:
    text: str
    op: str
    operands: list
    defs: set = field(default_factory=set)
    uses: set = field(default_factory=set)
    loads: list = field(default_factory=list)  # memory operands read
    stores: list = field(default_factory=list)  # memory operands written
    zero: bool = False  # a zero idiom (``vpxor %x, %x, %x``): a constant, no inputs


@dataclass
class Loop:
    function: str
    header: int  # block index
    blocks: frozenset
    instructions: int = 0  # own instructions (nested loops excluded)
    elements: float = 0.0  # elements per iteration (element loops)
    categories: dict = field(default_factory=dict)  # category -> own instructions
    nested: list = field(default_factory=list)
    trip: int | None = None  # iterations, from the induction variable
    element_loop: bool = False
    span: float = 0.0  # elements one iteration covers (outer loops: over nested loops)
    label: str = ""
    share: float = 1.0  # the elements of a row one pass through the row loop runs here / C

    @property
    def per_element(self) -> float:
        return self.instructions / self.span if self.span else math.nan

    def category_per_element(self) -> dict:
        return {c: self.categories.get(c, 0) / self.span if self.span else math.nan
                for c in CATEGORIES}


def _reg(name: str) -> str | None:
    m = _VREG.fullmatch(name)
    if m:
        return f"v{m.group(2)}"
    name = name.lstrip("%")
    if re.fullmatch(r"k[0-7]", name):
        return name
    return _GPR.get(name)


def _split_operands(text: str) -> list:
    out, depth, cur = [], 0, ""
    for ch in text:
        if ch in "({":
            depth += 1
        elif ch in ")}":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur.strip())
    return out


def _mem(operand: str) -> tuple | None:
    """``(displacement, base, index, scale)`` of a memory operand, else None."""
    m = re.match(r"^\*?([^(%$]*)\((%\w+)?(?:,\s*(%\w+))?(?:,\s*(\d+))?\)", operand)
    if not m:
        return None
    base = _reg(m.group(2)) if m.group(2) else None
    index = _reg(m.group(3)) if m.group(3) else None
    return (m.group(1).strip(), base, index, int(m.group(4) or 1))


def _width(operand: str) -> int:
    m = _VREG.search(operand)
    return _WIDTH[m.group(1)] if m else 0


def parse_insn(line: str) -> Insn:
    text = " ".join(line.split("#")[0].split())
    op, _, rest = text.partition(" ")
    operands = _split_operands(rest.strip().replace("\t", " ")) if rest.strip() else []
    insn = Insn(text, op, operands)
    mems = [(i, _mem(o)) for i, o in enumerate(operands)]
    for _, m in mems:
        if m:
            insn.uses |= {r for r in m[1:3] if r and r != "rip"}
    regs = [(i, _reg(re.sub(r"\{.*", "", o).strip())) for i, o in enumerate(operands)]
    regs = [(i, r) for i, r in regs if r]
    last = len(operands) - 1
    has_dest = bool(operands) and not _NO_DEST.match(op) and not op.startswith("j")
    dest_reg = next((r for i, r in regs if i == last), None) if has_dest else None
    dest_mem = mems[last][1] if has_dest and operands and mems[last][1] else None
    zero_idiom = bool(re.match(r"^v?p?xor", op)) and len(set(operands)) == 1 and len(operands) > 1
    insn.zero = zero_idiom
    for i, r in regs:
        if i != last or not has_dest:
            if not zero_idiom:
                insn.uses.add(r)
    if dest_reg:
        insn.defs.add(dest_reg)
        merge = "{%k" in operands[last] and "{z}" not in operands[last]
        two_op = len(operands) <= 2 and _LEGACY_RMW.match(op) and not zero_idiom
        if merge or two_op or op.startswith("vfm") or op.startswith("vfnm"):
            insn.uses.add(dest_reg)
        if op.startswith(("vpternlog", "vpermt2", "vpermi2")):  # the destination is a source
            insn.uses.add(dest_reg)
    for i, m in mems:
        if m and not op.startswith(("lea", "prefetch", "nop")):
            if i == last and has_dest and dest_mem:
                insn.stores.append((operands[i], m))
                if _LEGACY_RMW.match(op):
                    insn.loads.append((operands[i], m))
            else:
                insn.loads.append((operands[i], m))
    if re.match(r"^(cmp|test|add|sub|inc|dec|and|or|xor|neg|v?u?comis|vptest|bt)", op):
        insn.defs.add("flags")
    if op.startswith(("j", "cmov", "set", "adc", "sbb")) and op not in ("jmp", "jmpq"):
        insn.uses.add("flags")
    return insn


def lanes(insn: Insn, operand: str, dtype_bytes: int) -> tuple:
    """``(bytes, lanes)`` one access of ``insn`` to memory ``operand`` moves."""
    op = insn.op
    regs = [o for o in insn.operands if o != operand]
    width = max((_width(o) for o in regs), default=0)
    if "{1to" in operand:
        return 4, 1
    if re.match(r"^(vpmovzxwd|vpmovsxwd|vcvtph2ps)", op):
        return width // 2, width // 4
    if _NARROWING.match(op):
        return width // 2, width // 4
    if re.match(r"^(movzw|movsw|movw|vpinsrw|vpextrw|vpbroadcastw)", op):
        return 2, 1
    if re.search(r"ss$", op) or op in ("vbroadcastss",):
        return 4, 1
    if re.search(r"sd$", op) or op in ("vmovq", "movq") and not width:
        return 8, 1 if dtype_bytes == 8 else 8 // dtype_bytes
    if op in ("vmovd", "movl"):
        return 4, 4 // dtype_bytes
    if not width:  # a general-purpose register
        size = {"q": 8, "l": 4, "w": 2, "b": 1}.get(op[-1], 4)
        return size, max(1, size // dtype_bytes)
    if re.search(r"(ps|32|d)$", op) and not op.endswith(("dqu", "dqa")):
        return width, width // 4
    if op.endswith("16"):
        return width, width // 2
    return width, width // dtype_bytes


@dataclass
class Function:
    name: str
    insns: list  # [Insn]
    blocks: list  # [(start, end)] instruction ranges
    succ: list  # [set of block indices]


_BRANCH = re.compile(r"^j[a-z]+$")


def parse_functions(asm: str) -> dict:
    """``{name: Function}``: the instructions, basic blocks and edges of each function."""
    functions: dict = {}
    name, items = None, []

    def close():
        if name is not None:
            functions[name] = _function(name, items)

    for raw in asm.splitlines():
        line = raw.split("#")[0].rstrip()
        m = re.match(r"^\s*\.type\s+([^,]+),\s*@function", line)
        if m:
            close()
            name, items = m.group(1).strip(), []
            continue
        if name is None or not line.strip():
            continue
        m = re.match(r"^([.\w$@]+):", line)
        if m:
            items.append(("label", m.group(1)))
            continue
        stripped = line.strip()
        if stripped.startswith("."):
            if stripped.startswith((".size", ".Lfunc_end")):
                continue
            continue
        items.append(("insn", stripped))
    close()
    return functions


def _function(name: str, items: list) -> Function:
    insns, labels, leaders = [], {}, {0}
    for kind, value in items:
        if kind == "label":
            labels[value] = len(insns)
            leaders.add(len(insns))
        else:
            insn = parse_insn(value)
            insns.append(insn)
            if _BRANCH.match(insn.op) or insn.op.startswith("ret") or insn.op == "ud2":
                leaders.add(len(insns))
    starts = sorted(x for x in leaders if x < len(insns))
    blocks = [(s, (starts[i + 1] if i + 1 < len(starts) else len(insns)) - 1)
              for i, s in enumerate(starts)]
    block_at = {s: i for i, (s, _) in enumerate(blocks)}
    succ = []
    for i, (_, end) in enumerate(blocks):
        last = insns[end]
        out = set()
        if _BRANCH.match(last.op) and last.operands and not last.operands[0].startswith("*"):
            target = labels.get(last.operands[0])
            if target is not None and target in block_at:
                out.add(block_at[target])
        falls = not (last.op in ("jmp", "jmpq") or last.op.startswith("ret")
                     or last.op == "ud2")
        if falls and i + 1 < len(blocks):
            out.add(i + 1)
        succ.append(out)
    return Function(name, insns, blocks, succ)


def _dominators(succ: list) -> list:
    n = len(succ)
    pred = [set() for _ in range(n)]
    for u, outs in enumerate(succ):
        for v in outs:
            pred[v].add(u)
    reach, stack = {0}, [0]
    while stack:
        for v in succ[stack.pop()]:
            if v not in reach:
                reach.add(v)
                stack.append(v)
    dom = [set(reach) if i in reach else set() for i in range(n)]
    dom[0] = {0}
    changed = True
    while changed:
        changed = False
        for b in sorted(reach - {0}):
            ps = [dom[p] for p in pred[b] if p in reach]
            new = set.intersection(*ps) | {b} if ps else {b}
            if new != dom[b]:
                dom[b], changed = new, True
    return dom, pred


def find_loops(fn: Function) -> list:
    """The natural loops of ``fn`` (one per header), nesting filled in."""
    if not fn.blocks:
        return []
    dom, pred = _dominators(fn.succ)
    bodies: dict = {}
    for u, outs in enumerate(fn.succ):
        for h in outs:
            if h in dom[u]:  # back edge u -> h
                body, stack = {h, u}, [u]
                while stack:
                    x = stack.pop()
                    if x == h:
                        continue
                    for p in pred[x]:
                        if p not in body:
                            body.add(p)
                            stack.append(p)
                bodies.setdefault(h, set()).update(body)
    loops = [Loop(fn.name, h, frozenset(b)) for h, b in sorted(bodies.items())]
    for loop in loops:
        loop.nested = [o for o in loops if o is not loop and o.blocks < loop.blocks]
    return loops


def _own_insns(fn: Function, loop: Loop) -> list:
    inner = set().union(*(o.blocks for o in loop.nested)) if loop.nested else set()
    idx = []
    for b in sorted(loop.blocks - inner):
        s, e = fn.blocks[b]
        idx.extend(range(s, e + 1))
    return idx


def _trip(fn: Function, loop: Loop) -> int | None:
    """Iterations of ``loop``: an induction register stepped by a constant and
    compared with a constant (or stepped to zero, from a start above or below it),
    its start set before the loop."""
    idx = _own_insns(fn, loop)
    steps, bounds = {}, []
    for i in idx:
        insn = fn.insns[i]
        ops = insn.operands
        if len(ops) == 2 and insn.op[:3] in ("add", "sub") and ops[0].startswith("$"):
            reg = _reg(ops[1])
            value = int(ops[0][1:], 0)
            steps[reg] = value if insn.op.startswith("add") else -value
        elif len(ops) == 1 and insn.op[:3] in ("inc", "dec"):
            steps[_reg(ops[0])] = 1 if insn.op.startswith("inc") else -1
        elif insn.op.startswith("cmp") and len(ops) == 2 and ops[0].startswith("$"):
            bounds.append((_reg(ops[1]), int(ops[0][1:], 0)))
    header_start = fn.blocks[loop.header][0]
    inside = {i for b in loop.blocks for i in range(fn.blocks[b][0], fn.blocks[b][1] + 1)}

    def start(reg):
        for i in range(header_start - 1, -1, -1):
            if i in inside:
                continue
            insn = fn.insns[i]
            if reg in insn.defs:
                if re.match(r"^v?p?xor", insn.op) and len(set(insn.operands)) == 1:
                    return 0
                if insn.op.startswith("mov") and insn.operands[0].startswith("$"):
                    return int(insn.operands[0][1:], 0)
                return None
        return None

    bound = next((b for b in bounds if steps.get(b[0])), None)
    if bound:
        first = start(bound[0])
        if first is not None:
            n = (bound[1] - first) / steps[bound[0]]
            return math.ceil(n) if n > 0 else None
    for reg, step in steps.items():  # counted to zero: down from above, or up from below
        if bound is None:
            first = start(reg)
            if first and first * step < 0:
                return math.ceil(-first / step)
    return None


def _producers(body: list) -> tuple:
    """For each instruction of ``body``: ``{producer index}`` in the body (the last
    def before it, else the last def in the body: loop-carried), and the
    instructions on a recurrence (a cycle of the data flow through the loop's
    back edge: accumulators and induction variables)."""
    last_def: dict = {}
    for j, insn in enumerate(body):
        for r in insn.defs:
            last_def[r] = j
    current: dict = {}
    prods = []
    for j, insn in enumerate(body):
        ps = set()
        for r in insn.uses:
            if r in current:
                ps.add(current[r])
            elif r in last_def:
                ps.add(last_def[r])
        prods.append(ps)
        for r in insn.defs - {"flags"}:
            current[r] = j
    recurrent = set()
    for j in range(len(body)):
        stack, seen = list(prods[j]), set()
        while stack:
            p = stack.pop()
            if p == j:
                recurrent.add(j)
                break
            if p not in seen:
                seen.add(p)
                stack.extend(prods[p])
    return prods, recurrent


def classify(body: list, written: set) -> list:
    """The category (``CATEGORIES``) of each instruction of an element loop's body."""
    prods, carried = _producers(body)
    n = len(body)
    cons = [set() for _ in range(n)]
    for j, ps in enumerate(prods):
        for p in ps:
            cons[p].add(j)
    cat = [None] * n

    def streaming(mem):
        return any(r in written for r in mem[1:3] if r)

    stores_any = False
    for j, insn in enumerate(body):
        if any(streaming(m) for _, m in insn.stores):
            cat[j] = "store"
            stores_any = True
    for j, insn in enumerate(body):
        if cat[j] is None and any(streaming(m) for _, m in insn.loads) and (
                _MOVE.match(insn.op) or _WIDEN.match(insn.op)):
            cat[j] = "load"
    for j, insn in enumerate(body):  # widening of loaded values (program order)
        if cat[j] is None and _WIDEN.match(insn.op) and prods[j] and all(
                cat[p] == "load" for p in prods[j]
                if "v" in "".join(body[p].defs) and not body[p].zero):
            cat[j] = "load"
    for j, insn in enumerate(body):  # the zero words a widening interleaves
        if cat[j] is None and insn.zero and cons[j] and all(cat[c] == "load" for c in cons[j]):
            cat[j] = "load"
    changed = True
    while changed:  # integer vector work that only reaches stores: narrowing
        changed = False
        for j in range(n - 1, -1, -1):
            insn = body[j]
            if cat[j] is None and (insn.op.startswith(("vp", "vinsert", "vextract"))
                                   or _NARROWING.match(insn.op)) \
                    and not insn.op.startswith(("vpcmp", "vpbroadcast")) \
                    and cons[j] and all(cat[c] in ("store", "narrow") for c in cons[j]):
                cat[j], changed = "narrow", True
    for j, insn in enumerate(body):
        if cat[j] is None and j in carried and insn.op.startswith("vmax"):
            cat[j] = "max"
        elif cat[j] is None and j in carried and re.match(r"^(vadd|vfm)", insn.op):
            cat[j] = "sum"
    markers = {j for j, insn in enumerate(body) if insn.op.startswith("vscalef")}
    pow2 = {j for j, insn in enumerate(body)
            if insn.op == "vpslld" and insn.operands and insn.operands[0] == "$23"}
    markers = {c for j in pow2 for c in cons[j]} | markers | pow2
    stack, seen = list(markers), set()
    while stack:
        j = stack.pop()
        if j in seen:
            continue
        seen.add(j)
        if cat[j] is None:
            cat[j] = "exp"
        if cat[j] == "exp" or j in markers:  # an exp fused into a sum's FMA: its inputs
            stack.extend(p for p in prods[j] if cat[p] in (None, "exp"))
    for j, insn in enumerate(body):
        if cat[j] is None:
            vector = insn.op.startswith("v") and not re.match(r"^vmov(aps|ups|dqa|dqu)", insn.op)
            mask = insn.op.startswith("k")
            cat[j] = "grad" if stores_any and (vector or mask) else "other"
    return cat


def analyse_asm(asm: str, dtype_bytes: int, classes: int) -> list:
    """Every loop of every function of ``asm`` (``Loop``), element loops counted."""
    found = []
    for fn in parse_functions(asm).values():
        loops = find_loops(fn)
        for loop in loops:
            idx = _own_insns(fn, loop)
            loop.instructions = len(idx)
            loop.trip = _trip(fn, loop)
            body = [fn.insns[i] for i in idx]
            all_idx = [i for b in loop.blocks for i in range(fn.blocks[b][0], fn.blocks[b][1] + 1)]
            written = set().union(*(fn.insns[i].defs for i in all_idx)) - {"flags"}
            if loop.nested:
                loop.categories = {"other": len(idx)}
                continue
            cats = classify(body, written)
            prods = _producers(body)[0]
            streams: dict = {}
            for j, insn in enumerate(body):
                for kind, accesses in (("load", insn.loads), ("store", insn.stores)):
                    for operand, mem in accesses:
                        if any(r in written for r in mem[1:3] if r):
                            key = (kind, mem[1], mem[2], mem[3])
                            n = lanes(insn, operand, dtype_bytes)[1]
                            if kind == "store" and re.match(r"^v?movdq", insn.op) and any(
                                    cats[p] not in ("narrow", "other") for p in prods[j]):
                                n = lanes(insn, operand, 4)[1]  # a float32 value, not narrowed
                            streams.setdefault(key, {})[mem[0]] = n
            if not streams:
                continue
            loop.element_loop = True
            loop.elements = loop.span = max(sum(s.values()) for s in streams.values())
            loop.categories = {c: cats.count(c) for c in CATEGORIES}
        for loop in sorted(loops, key=lambda x: len(x.blocks)):  # inner first
            if loop.nested:
                children = [o for o in loop.nested
                            if not any(o.blocks < p.blocks for p in loop.nested)]
                spans = [c.span * c.trip for c in children if c.span and c.trip]
                loop.span = max(spans, default=0.0)
        _alternatives(fn, loops)
        _shares(loops, classes)
        found.extend(loop for loop in loops if loop.element_loop or loop.span)
    return found


def _alternatives(fn: Function, loops: list) -> None:
    """Mark element loops that are alternatives of one another (``label`` "alt N"):
    nested directly in one loop (or none) and neither reaching the other without
    going round that loop."""
    elements = [x for x in loops if x.element_loop]
    groups = 0
    for a in elements:
        if a.label:
            continue
        parent = min((p for p in loops if a.blocks < p.blocks), key=lambda p: len(p.blocks),
                     default=None)
        mates = [b for b in elements if b is not a and not b.label and min(
            (p for p in loops if b.blocks < p.blocks), key=lambda p: len(p.blocks),
            default=None) is parent and not _reaches(fn, a, b, parent)
            and not _reaches(fn, b, a, parent)]
        if mates:
            groups += 1
            for x in [a, *mates]:
                x.label = f"alt{groups}"


def _reaches(fn: Function, a: Loop, b: Loop, parent: Loop | None) -> bool:
    """Does control leave loop ``a`` and reach loop ``b`` without taking the back edge
    to ``parent``'s header?"""
    stack = [x for blk in a.blocks for x in fn.succ[blk] if x not in a.blocks]
    seen = set()
    while stack:
        x = stack.pop()
        if x in b.blocks:
            return True
        if x in seen or (parent is not None and (x == parent.header or x not in parent.blocks)):
            continue
        seen.add(x)
        stack.extend(fn.succ[x])
    return False


def row_loops(loops: list) -> list:
    """The loops of the function that sweeps the rows: the one whose loop covers
    the most elements per iteration (TVM's parallel row lambda; the entry
    function's loops run over rows or class weights, not a row's elements)."""
    if not loops:
        return []
    function = max(loops, key=lambda x: x.span).function
    return [x for x in loops if x.function == function]


def _chosen(loops: list) -> list:
    """The loops an element is charged for: all, but of alternatives the costliest."""
    best: dict = {}
    for loop in loops:
        if loop.label and loop.per_element > best.get(loop.label, (-1.0, None))[0]:
            best[loop.label] = (loop.per_element, loop)
    return [x for x in loops if not x.label and x.span] + [x for _, x in best.values()]


def kernel_per_element(loops: list) -> float:
    """Instructions per element of a row: each loop's instructions per element
    times the share of a row's elements it runs (its iterations per pass of the
    row loop over C; 1 where a trip count is not known), alternatives charged
    their costliest."""
    return sum(loop.per_element * loop.share for loop in _chosen(loops))


def kernel_categories(loops: list) -> dict:
    """``kernel_per_element`` split by category."""
    out = dict.fromkeys(CATEGORIES, 0.0)
    for loop in _chosen(loops):
        for c, v in loop.category_per_element().items():
            out[c] += v * loop.share
    return out


def _within_a_row(loop: Loop, classes: int) -> bool:
    return loop.trip is None or loop.span * loop.trip < 1.5 * classes


def _shares(loops: list, classes: int) -> None:
    """``Loop.share`` of each loop of one function: elements per iteration times its
    trip count and those of the loops around it within a row, over ``classes``.
    Loops over rows are not within a row: the outermost (the tasks' rows) and any
    whose iterations cover 1.5 rows or more (the rows of one parallel task,
    ``row_grain``; a row's chunk loop covers at most a row and the overlap of its
    last chunk). A group of alternatives shares the largest of its members'."""
    for loop in loops:
        outer = [p for p in loops if loop.blocks < p.blocks]
        if not outer:
            loop.share = min(1.0, loop.span / classes) if loop.nested else 1.0
            continue
        row = max(outer, key=lambda p: len(p.blocks))
        trips = [p.trip for p in [loop] + outer if p is not row and _within_a_row(p, classes)]
        if all(trips) and loop.span:
            loop.share = loop.span * math.prod(trips) / classes
        else:
            loop.share = 1.0
    groups: dict = {}
    for loop in loops:
        if loop.label:
            groups[loop.label] = max(groups.get(loop.label, 0.0), loop.share)
    for loop in loops:
        if loop.label:
            loop.share = groups[loop.label]


def parse_target(target: str) -> dict:
    """``"llvm -mcpu=znver5 -mattr=+avx2"`` -> TVM's target dict (``num-cores`` of the
    runtime's description; it does not change the element loops)."""
    words = target.split()
    if not words or words[0] != "llvm":
        raise ValueError(f"a CPU target starts with 'llvm', got {target!r}")
    desc = {"kind": "llvm"}
    for word in words[1:]:
        key, _, value = word.lstrip("-").partition("=")
        desc[key] = value.split(",") if key == "mattr" else value
    desc.setdefault("mcpu", "generic")
    desc.setdefault("num-cores", 2)
    return desc


def cross_spec(op: str, dtype: str, classes: int, target: str = "llvm -mcpu=znver5",
               weighted: bool = False, reduction: str = "mean"):
    """The ``KernelSpec`` of one shape (``op`` a key of ``OPS``) built for ``target``
    (``parse_target``) instead of this host's CPU."""
    from tvm.target import Target

    from ..kernels.kinds import Variant
    from ..store.spec import KernelSpec

    spec_op, extra = OPS[op]
    if spec_op in ("log_probs", "log_probs_grad"):
        variant = Variant(**extra)
    else:
        variant = Variant(reduction, weighted, **extra)
    description = parse_target(target)

    @dataclass(frozen=True)
    class CrossSpec(KernelSpec):
        """A CPU kernel for ``description`` instead of this host's CPU."""

        def target_description(self):
            return dict(description)

        def tvm_target(self):
            return Target(dict(description))

    return CrossSpec(spec_op, dtype, classes, variant, "llvm")


def cpu_asm(op: str, dtype: str, classes: int, target: str = "llvm -mcpu=znver5",
            weighted: bool = False, reduction: str = "mean", lagged: bool = True) -> str:
    """The x86 assembly (AT&T) of one shape, built as the runtime builds it and
    as a launch larger than the caches runs it (``always_streaming``: the
    streamed gradient stores alone, not beside the plain ones). ``lagged``
    False: a 16-bit training kernel keeps each row's gradient in the row's
    iteration (``cpu_lagged_rows.unlagged``), the form ``analyse`` counts."""
    from ..compiler.build import lower_and_compile
    from ..schedules.cpu_lagged_rows import unlagged
    from ..schedules.cpu_stores import always_streaming

    spec = cross_spec(op, dtype, classes, target, weighted, reduction)
    with always_streaming(), (contextlib.nullcontext() if lagged else unlagged()):
        return lower_and_compile(spec).mod.inspect_source("asm")


@dataclass
class Summary:
    label: str
    loops: list
    per_element: float
    categories: dict
    zmm: int  # instructions naming a zmm register
    avx512: int  # instructions only AVX-512 has (zmm, mask registers, EVEX-only forms)


_AVX512_ONLY = re.compile(r"%zmm|%k[0-7]|\{1to\d+\}|%[xy]mm(1[6-9]|2\d|3[01])\b|^\s*v(scalef|"
                          r"rndscale|cvtne2?ps2bf16|pmov[us]?[dq][wb]|pternlog|permt2|permi2|"
                          r"extract[fi](32|64)x|insert[fi](32|64)x|broadcast[fi](32|64)x|"
                          r"movdq[au](8|16|32|64)|pcmp[a-z]*\s.*%k|getexp|getmant|fixupimm|"
                          r"compress|expand|pconflict|plzcnt|pmull[q]|cvtqq|cvtuqq)")


def avx512_lines(asm: str) -> list:
    """Instruction lines of ``asm`` that need AVX-512 (zmm or mask registers,
    registers 16-31, embedded broadcasts, EVEX-only instructions)."""
    out = []
    for raw in asm.splitlines():
        line = raw.split("#")[0]
        if line.startswith("\t") and not line.strip().startswith(".") and _AVX512_ONLY.search(line):
            out.append(line.strip())
    return out


@functools.cache
def analyse(op: str, dtype: str, classes: int, target: str = "llvm -mcpu=znver5",
            weighted: bool = False, reduction: str = "mean") -> Summary:
    """``Summary`` of one shape (cached per process)."""
    asm = cpu_asm(op, dtype, classes, target, weighted, reduction, lagged=False)
    loops = row_loops(analyse_asm(asm, DTYPE_BYTES[dtype], classes))
    mcpu = parse_target(target)["mcpu"]
    label = f"{op} {dtype} C={classes} {mcpu}"
    zmm = sum("%zmm" in line for line in asm.splitlines())
    return Summary(label, loops, kernel_per_element(loops), kernel_categories(loops), zmm,
                   len(avx512_lines(asm)))


def loop_table(summary: Summary) -> str:
    """One line per loop: own instructions, elements per iteration, insn/el, categories."""
    head = (f"  {'loop':22} {'insn':>5} {'el/it':>6} {'share':>6} {'insn/el':>8} "
            + " ".join(f"{c:>6}" for c in CATEGORIES))
    out = [head]
    for loop in summary.loops:
        kind = "element" if loop.element_loop else f"outer x{loop.trip or '?'}"
        name = f"{kind} {loop.label}".strip()
        cats = loop.category_per_element()
        out.append(f"  {name:22} {loop.instructions:5d} {loop.span:6.0f} {loop.share:6.3f} "
                   f"{loop.per_element:8.3f} " + " ".join(f"{cats[c]:6.3f}" for c in CATEGORIES))
    return "\n".join(out)


def table(summaries: list) -> str:
    """One line per kernel: instructions per element and their categories."""
    head = (f"{'kernel':40} {'insn/el':>8} " + " ".join(f"{c:>6}" for c in CATEGORIES)
            + f" {'loops':>5}")
    out = [head, "-" * len(head)]
    for s in summaries:
        out.append(f"{s.label:40} {s.per_element:8.2f} "
                   + " ".join(f"{s.categories[c]:6.2f}" for c in CATEGORIES)
                   + f" {sum(x.element_loop for x in s.loops):5d}")
    return "\n".join(out)


__all__ = ["CATEGORIES", "DTYPE_BYTES", "OPS", "Loop", "Summary", "analyse", "analyse_asm",
           "avx512_lines", "classify", "cpu_asm", "cross_spec", "find_loops", "kernel_categories",
           "kernel_per_element", "loop_table", "parse_functions", "parse_insn", "parse_target",
           "table"]
