"""Reading a compiled (optimised, SPMD-partitioned) HLO module's text: per-device matmul
FLOPs and collectives counted with loop trip counts, and the parameters aliased to outputs.

XLA's `cost_analysis()` counts a while loop's body once, not once per iteration, so a scan
over a transformer's blocks is undercounted by its length (TPU_AOT_TRIAL.md). Here every
computation gets a multiplier: how often one call of the entry computation runs it (a
while body: its caller's multiplier times the loop's trip count, XLA's `known_trip_count`
or ceil(N / step) from its condition `i < N` and the constant its body adds to i (a scan
steps by 1, XLA's bidirectional windowed matmuls by 2); a fusion, call or branch: its
caller's). A conditional counts every branch (an upper bound).

- `dot_flops`: 2 x output elements x contracted size of every `dot` and `convolution`
  (TPU emits matmuls as convolutions; the contracted size is the kernel's input-feature
  dims times the window positions an output reads), per device.
- `collectives`: per kind (all-gather, all-reduce, reduce-scatter, all-to-all,
  collective-permute), executions and bytes of their results, per device (an async
  collective's copies, one channel id, count once).
- `bytes_accessed`: HBM bytes read and written by the instructions of the loop bodies and
  the entry (fusions as units), per device, an estimate.
- `aliased_parameters`: the entry parameters the module's `input_output_alias` reuses
  for an output (donation that took effect).
"""

from __future__ import annotations

import math
import re
from typing import NamedTuple

_DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "f8e4m3fn": 1,
                "f8e5m2": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4,
                "u32": 4, "f64": 8, "s64": 8, "u64": 8, "c64": 8, "c128": 16}
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_INSTR = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.*?) ([a-z][\w\-]*)\((.*)$")
_HEADER = re.compile(r"^(ENTRY )?%?([\w.\-]+) .*\{\s*$")
_CALLEES = re.compile(r"\b(calls|to_apply|body|condition|true_computation|"
                      r"false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
# ops that move no HBM bytes themselves (their bodies, if any, are counted where they run)
_FREE = ("parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "call",
         "conditional", "after-all", "partition-id", "replica-id", "opt-barrier")
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all",
               "collective-permute")


class Instr(NamedTuple):
    name: str
    shape: str  # the result's shape text
    opcode: str
    rest: str  # operands and attributes


def arrays(shape: str) -> list[tuple[str, tuple[int, ...]]]:
    """(dtype, dims) of every array in a shape text (one, or a tuple's)."""
    return [(t, tuple(int(d) for d in dims.split(",") if d))
            for t, dims in _ARRAY.findall(re.sub(r"\{[^{}]*\}", "", shape))
            if t in _DTYPE_BYTES]


def nbytes(shape: str) -> float:
    return sum(_DTYPE_BYTES[t] * math.prod(d) for t, d in arrays(shape))


class Module:
    """The computations of an HLO module text, each a list of instructions."""

    def __init__(self, text: str):
        self.text = text
        self.computations: dict[str, list[Instr]] = {}
        self.entry = ""
        current = None
        for line in text.splitlines():
            if current is None:
                m = _HEADER.match(line)
                if m and "=" not in line.split("(")[0]:
                    current = m.group(2)
                    self.computations[current] = []
                    if m.group(1):
                        self.entry = current
            elif line.startswith("}"):
                current = None
            elif m := _INSTR.match(line):
                self.computations[current].append(Instr(*m.groups()))

    def multipliers(self) -> dict[str, int]:
        """{computation: executions per call of the entry computation}."""
        return self._walk()[0]

    def _walk(self) -> tuple[dict[str, int], set[str]]:
        """(multipliers, the control computations: the entry and what loops, calls and
        conditionals run, whose instructions each read and write HBM; not fusion bodies)."""
        calls: dict[str, list[tuple[str, int, bool]]] = {}
        for comp, instrs in self.computations.items():
            for ins in instrs:
                trip = self._trip_count(ins) if ins.opcode == "while" else 1
                control = ins.opcode in ("while", "call", "conditional")
                for kind, callee in _CALLEES.findall(ins.rest):
                    n = trip if kind == "body" else trip + 1 if kind == "condition" else 1
                    calls.setdefault(comp, []).append((callee, n, control))
                for m in _BRANCHES.finditer(ins.rest):
                    for callee in re.findall(r"%?([\w.\-]+)", m.group(1)):
                        calls.setdefault(comp, []).append((callee, 1, True))
        mult: dict[str, int] = {}
        controls: set[str] = set()

        def visit(comp: str, m: int, control: bool, depth: int = 0) -> None:
            if depth > 64 or comp not in self.computations:
                return
            mult[comp] = mult.get(comp, 0) + m
            if control:
                controls.add(comp)
            for callee, n, is_control in calls.get(comp, ()):
                visit(callee, m * n, control and is_control, depth + 1)

        visit(self.entry, 1, True)
        return mult, controls

    def _trip_count(self, ins: Instr) -> int:
        """A while loop's iterations: XLA's `known_trip_count`, else the bound of its
        condition `i < N` (a scan's, counting from 0); 1 when neither can be read."""
        m = _TRIP.search(ins.rest)
        if m:
            return int(m.group(1))
        cond = re.search(r"condition=%?([\w.\-]+)", ins.rest)
        instrs = self.computations.get(cond.group(1), []) if cond else []
        consts = {i.name: int(v.group(1)) for i in instrs if i.opcode == "constant"
                  and (v := re.match(r"(-?\d+)\)", i.rest))}
        index = {i.name: int(k.group(1)) for i in instrs if i.opcode == "get-tuple-element"
                 and (k := re.search(r"index=(\d+)", i.rest))}
        for i in instrs:
            if i.opcode == "compare" and "direction=LT" in i.rest:
                operands = re.findall(r"%([\w.\-]+)", i.rest.split(")", 1)[0])
                bounds = [consts[o] for o in operands[1:] if o in consts]
                if bounds and bounds[0] > 0:
                    step = self._loop_step(ins, index.get(operands[0]))
                    return -(-bounds[0] // step)
        return 1

    def _loop_step(self, ins: Instr, k: int | None) -> int:
        """The constant a while body adds to its loop counter (tuple element k); 1 when it
        cannot be read (XLA's bidirectional windowed matmuls step by 2)."""
        body = re.search(r"body=%?([\w.\-]+)", ins.rest)
        instrs = self.computations.get(body.group(1), []) if body else []
        if k is None or not instrs:
            return 1
        by_name = {i.name: i for i in instrs}
        consts = {i.name: int(v.group(1)) for i in instrs if i.opcode == "constant"
                  and (v := re.match(r"(-?\d+)\)", i.rest))}
        root = instrs[-1]
        elements = re.findall(r"%([\w.\-]+)", root.rest.split(")", 1)[0])
        update = by_name.get(elements[k]) if root.opcode == "tuple" and k < len(elements) else None
        if update is None or update.opcode != "add":
            return 1
        steps = [consts[o] for o in re.findall(r"%([\w.\-]+)", update.rest.split(")", 1)[0])
                 if o in consts]
        return steps[0] if steps and steps[0] > 0 else 1

    def _shapes(self, comp: str) -> dict[str, str]:
        return _shapes_of(self.computations[comp])

    def dot_flops(self) -> float:
        """Per-device matmul FLOPs of one call, loops counted by their trip counts."""
        total = 0.0
        for comp, m in self.multipliers().items():
            shapes = None
            for ins in self.computations[comp]:
                if ins.opcode not in ("dot", "convolution"):
                    continue
                shapes = shapes or self._shapes(comp)
                out = arrays(ins.shape)
                operands = re.findall(r"%([\w.\-]+)", ins.rest.split(")", 1)[0])
                if not out or len(operands) < 2:
                    continue
                lhs, rhs = (arrays(shapes.get(o, ""))[:1] for o in operands[:2])
                total += m * 2 * math.prod(out[0][1]) * _contracted(ins, lhs, rhs)
        return total

    def bytes_accessed(self) -> float:
        """Per-device HBM bytes of one call, loops counted by their trip counts: each
        instruction of a control computation (a fusion as one: its body stays on chip)
        reads its operands and writes its result, except that a dynamic slice reads only
        its slice and a dynamic update (a loop writing its stacked outputs in place)
        writes only its update. An estimate."""
        mult, controls = self._walk()
        total = 0.0
        for comp in controls:
            shapes = self._shapes(comp)
            for ins in self.computations[comp]:
                if ins.opcode not in _FREE:
                    total += mult[comp] * self._traffic(ins, shapes)
        return total

    def _traffic(self, ins: Instr, shapes: dict[str, str]) -> float:
        """Bytes one top-level instruction reads and writes (see bytes_accessed)."""
        operands = re.findall(r"%([\w.\-]+)", ins.rest.split(")", 1)[0])
        sizes = [nbytes(shapes.get(o, "")) for o in operands]
        out = nbytes(ins.shape)
        body = None
        if ins.opcode == "fusion":
            callee = re.search(r"calls=%?([\w.\-]+)", ins.rest)
            body = self.computations.get(callee.group(1)) if callee else None
        if ins.opcode == "dynamic-slice" and sizes:
            return 2 * out
        if ins.opcode == "dynamic-update-slice" and len(sizes) > 1:
            return 2 * sizes[1]
        if not body:
            return out + sum(sizes)
        params = {i.name: int(re.match(r"(\d+)", i.rest).group(1)) for i in body
                  if i.opcode == "parameter" and re.match(r"\d+", i.rest)}
        users: dict[str, list[Instr]] = {}
        for i in body:
            for o in re.findall(r"%([\w.\-]+)", i.rest.split(")", 1)[0]):
                users.setdefault(o, []).append(i)
        root, shapes_in = body[-1], _shapes_of(body)
        for name, k in params.items():  # a parameter only sliced: the slices are read
            use = users.get(name, [])
            if k < len(sizes) and use and all(u.opcode == "dynamic-slice" for u in use):
                sizes[k] = sum(nbytes(u.shape) for u in use)
        dus = [i for i in body if i.opcode == "dynamic-update-slice"]
        if dus and nbytes(root.shape) == out:
            # written in place: the buffer operand is neither read nor rewritten whole
            for i in dus:
                ops = re.findall(r"%([\w.\-]+)", i.rest.split(")", 1)[0])
                if ops and ops[0] in params and params[ops[0]] < len(sizes):
                    buffer = params[ops[0]]
                    update = nbytes(shapes_in.get(ops[1], "")) if len(ops) > 1 else 0
                    out -= sizes[buffer] - update
                    sizes[buffer] = 0
        return max(out, 0) + sum(sizes)


    def collectives(self) -> dict[str, dict[str, float]]:
        """{kind: {"count": executions, "bytes": result bytes}} per device, per call."""
        seen: dict[tuple, tuple[str, int, float]] = {}
        for comp, m in self.multipliers().items():
            for i, ins in enumerate(self.computations[comp]):
                kind = ins.opcode.removesuffix("-start")
                if kind not in COLLECTIVES:
                    continue
                # an async collective's start and done each hold a copy: one channel
                channel = re.search(r"channel_id=(\d+)", ins.rest)
                key = ("channel", channel.group(1)) if channel else (comp, i)
                if key not in seen or seen[key][1] < m:
                    seen[key] = (kind, m, nbytes(ins.shape))
        out = {k: {"count": 0, "bytes": 0.0} for k in COLLECTIVES}
        for kind, m, size in seen.values():
            out[kind]["count"] += m
            out[kind]["bytes"] += m * size
        return out

    def aliased_parameters(self) -> set[int]:
        """Entry parameter numbers that `input_output_alias` gives to an output."""
        start = self.text.find("input_output_alias={")
        if start < 0:
            return set()
        depth, i = 0, start + len("input_output_alias=")
        for i in range(i, len(self.text)):  # to the matching brace
            depth += {"{": 1, "}": -1}.get(self.text[i], 0)
            if depth == 0:
                break
        return {int(p) for p in re.findall(r":\s*\((\d+),", self.text[start:i])}


def _shapes_of(instrs: list[Instr]) -> dict[str, str]:
    """{instruction name: result shape text} of one computation."""
    return {i.name: i.shape for i in instrs}


def _contracted(ins: Instr, lhs, rhs) -> int:
    """The contracted size of a dot or convolution (1 when it cannot be read)."""
    if ins.opcode == "dot":
        m = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", ins.rest)
        if not m or not lhs:
            return 1
        dims = lhs[0][1]
        return math.prod(dims[int(d)] for d in m.group(1).split(",") if d)
    m = re.search(r"dim_labels=(\w+)_(\w+)->", ins.rest)
    if not m or not rhs or not lhs:
        return 1
    (lhs_labels, labels), dims = m.groups(), rhs[0][1]
    if len(labels) != len(dims) or len(lhs_labels) != len(lhs[0][1]):
        return 1
    # Window positions one output reads from real input: TPU puts a batched matmul's batch
    # dims in a window of size s over an input dilated by s (one real tap), and a split
    # output dim in a window of size s over an input of size 1 padded around (one real tap).
    spatial = {c: n for c, n in zip(lhs_labels, lhs[0][1]) if c.isdigit()}
    window = re.search(r"window=\{([^}]*)\}", ins.rest)
    taps = 1
    if window:
        size = re.search(r"size=([\dx]+)", window.group(1))
        dilate = re.search(r"lhs_dilate=([\dx]+)", window.group(1))
        sizes = [int(v) for v in size.group(1).split("x")] if size else []
        dilates = [int(v) for v in dilate.group(1).split("x")] if dilate else [1] * len(sizes)
        for d, (w, k) in enumerate(zip(sizes, dilates)):
            n = spatial.get(str(d), w)
            taps *= -(-min(w, (n - 1) * k + 1) // k)
    return taps * math.prod(d for c, d in zip(labels, dims) if c == "i")
