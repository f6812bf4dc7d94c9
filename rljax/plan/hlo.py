"""Reading a compiled per-chip HLO module: collective bytes per loop iteration, largest tensors.

The text of `compiled.as_text()` is the program one chip runs after SPMD partitioning, so every
shape in it is a per-chip shape. Two figures come out of it:

- collective bytes: the output size of every all-gather, all-reduce, reduce-scatter, all-to-all
  and collective-permute (the `-done` half of an async pair), each multiplied by how many times
  its loop runs. A `while` whose trip count is known (the CPU compiler writes `known_trip_count`;
  the TPU compiler leaves a condition `counter < constant`) multiplies its body; a `while` whose
  condition depends on data (the sampler's decode loop: "until every row stopped") is a dynamic
  loop, and one iteration of it is one decode token.
- the largest tensors: instruction outputs outside fused computations (what is materialised in
  memory), largest first, to see whether any carries the global batch or a T x T score matrix.
"""
from __future__ import annotations

import dataclasses
import math
import re

COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute",
               "collective-broadcast", "ragged-all-to-all")
_DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
                "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_ARRAY = re.compile(r"\b([a-z]+[0-9]*(?:e[0-9]m[0-9][a-z0-9]*)?)\[([0-9,]*)\]")
_CALLS = re.compile(r"\b(calls|body|condition|to_apply|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_OPNAME = re.compile(r'op_name="([^"]*)"')
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_NO_MEMORY = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "after-all", "partition-id",
              "replica-id", "copy-start", "copy-done", "opt-barrier"}


def dtype_bytes(dtype: str) -> float:
  if dtype.startswith("f8"):
    return 1
  return _DTYPE_BYTES.get(dtype, 0)


def arrays(type_text: str) -> list[tuple[str, tuple[int, ...]]]:
  """[(dtype, dims)] of every array in an HLO type (a tuple type lists several)."""
  out = []
  for dtype, dims in _ARRAY.findall(type_text):
    if dtype_bytes(dtype) or dtype == "token":
      out.append((dtype, tuple(int(d) for d in dims.split(",") if d)))
  return out


def type_bytes(type_text: str) -> int:
  return int(sum(math.prod(dims) * dtype_bytes(dt) for dt, dims in arrays(type_text)))


@dataclasses.dataclass
class Instruction:
  name: str
  type: str
  opcode: str
  rest: str           # operands and attributes
  root: bool = False

  @property
  def callees(self) -> list[tuple[str, str]]:
    """[(role, computation)] this instruction calls (body, condition, calls, to_apply, branches)."""
    out = [(role, name) for role, name in _CALLS.findall(self.rest)]
    for group in _BRANCHES.findall(self.rest):
      out += [("branch", b.strip().lstrip("%")) for b in group.split(",") if b.strip()]
    return out

  @property
  def op_name(self) -> str:
    m = _OPNAME.search(self.rest)
    return m.group(1) if m else ""


@dataclasses.dataclass
class Computation:
  name: str
  instructions: list[Instruction]
  entry: bool = False

  def root(self) -> Instruction | None:
    return next((i for i in self.instructions if i.root), self.instructions[-1] if self.instructions else None)

  def get(self, name: str) -> Instruction | None:
    return next((i for i in self.instructions if i.name == name), None)


def _split_type(text: str) -> tuple[str, str]:
  """'(a, b) op(...' or 'f32[2]{0} op(...' -> (type, rest starting at the opcode)."""
  if text.startswith("("):
    depth = 0
    for k, ch in enumerate(text):
      depth += ch == "("
      depth -= ch == ")"
      if depth == 0:
        return text[:k + 1], text[k + 1:].lstrip()
  head, _, tail = text.partition(" ")
  return head, tail


def parse_module(text: str) -> dict[str, Computation]:
  """The computations of an HLO module's text, by name."""
  comps: dict[str, Computation] = {}
  current: Computation | None = None
  for line in text.splitlines():
    if not line.strip() or line.lstrip().startswith("//"):
      continue
    if not line[0].isspace():
      if line.startswith("}"):
        current = None
        continue
      if line.rstrip().endswith("{") and not line.startswith("HloModule"):
        entry = line.startswith("ENTRY")
        name = line.split()[1 if entry else 0].lstrip("%")
        current = Computation(name, [], entry)
        comps[name] = current
      continue
    if current is None or " = " not in line:
      continue
    body = line.strip()
    root = body.startswith("ROOT ")
    if root:
      body = body[5:]
    name, _, rhs = body.partition(" = ")
    type_text, rest = _split_type(rhs)
    m = re.match(r"([\w\-.]+)\(", rest)
    if not m:
      continue
    current.instructions.append(Instruction(name.lstrip("%"), type_text, m.group(1), rest[m.end():], root))
  return comps


def collective_kind(opcode: str) -> str | None:
  """'all-gather' for all-gather and all-gather-done; None for -start halves and other ops."""
  if opcode.endswith("-start"):
    return None
  base = opcode[:-5] if opcode.endswith("-done") else opcode
  return base if base in COLLECTIVES else None


@dataclasses.dataclass
class Loop:
  """A while loop: its body and condition, and its trip count (None: depends on data)."""
  instruction: Instruction
  body: str
  condition: str
  trips: int | None


class Module:
  """A parsed per-chip HLO module with collective accounting."""

  def __init__(self, text: str):
    self.comps = parse_module(text)
    self.entry = next((c for c in self.comps.values() if c.entry), None)
    if self.entry is None:
      raise ValueError("no ENTRY computation in the HLO text")
    self._memo: dict[tuple[str, bool], dict[str, float]] = {}

  # ---- loops ------------------------------------------------------------------------------

  def loop(self, inst: Instruction) -> Loop:
    callees = dict(inst.callees)
    body, cond = callees.get("body", ""), callees.get("condition", "")
    m = _TRIP.search(inst.rest)
    trips = int(m.group(1)) if m else self._trips_from_condition(cond, body)
    return Loop(inst, body, cond, trips)

  def _trips_from_condition(self, cond: str, body: str) -> int | None:
    """`ROOT compare(counter, constant N), direction=LT` with the counter stepping by k -> ceil(N / k)."""
    comp = self.comps.get(cond)
    root = comp.root() if comp else None
    if root is None or root.opcode != "compare" or "direction=LT" not in root.rest:
      return None
    operands = re.findall(r"%([\w.\-]+)", root.rest.split(")")[0])
    if len(operands) != 2:
      return None
    bound = comp.get(operands[1])
    counter = comp.get(operands[0])
    if bound is None or bound.opcode != "constant" or counter is None or counter.opcode != "get-tuple-element":
      return None
    n = int(re.match(r"\s*(-?\d+)", bound.rest).group(1))
    index = re.search(r"index=(\d+)", counter.rest)
    step = self._counter_step(body, int(index.group(1)) if index else 0)
    return max(0, -(-n // step))

  def _counter_step(self, body: str, index: int) -> int:
    """The constant the body adds to tuple element `index` (1 when it cannot tell)."""
    comp = self.comps.get(body)
    root = comp.root() if comp else None
    if root is None or root.opcode != "tuple":
      return 1
    operands = re.findall(r"%([\w.\-]+)", root.rest)
    if index >= len(operands):
      return 1
    add = comp.get(operands[index])
    if add is None or add.opcode != "add":
      return 1
    for name in re.findall(r"%([\w.\-]+)", add.rest.split(")")[0]):
      c = comp.get(name)
      if c is not None and c.opcode == "constant":
        m = re.match(r"\s*(\d+)", c.rest)
        if m and int(m.group(1)) > 0:
          return int(m.group(1))
    return 1

  # ---- collectives --------------------------------------------------------------------------

  def collectives(self, comp: str | None = None, *, dynamic: bool = True) -> dict[str, float]:
    """Bytes by collective kind executed by one run of `comp` (default: the entry).

    Loops with a known trip count multiply their body; dynamic loops count once when
    `dynamic`, and are left out when not (see `dynamic_loops` for them).
    """
    name = comp or self.entry.name
    key = (name, dynamic)
    if key in self._memo:
      return self._memo[key]
    self._memo[key] = {}   # guards against recursion
    total: dict[str, float] = {}
    for inst in self.comps[name].instructions if name in self.comps else ():
      kind = collective_kind(inst.opcode)
      if kind:
        total[kind] = total.get(kind, 0) + type_bytes(inst.type)
      if inst.opcode == "while":
        lp = self.loop(inst)
        if lp.trips is None and not dynamic:
          continue
        times = 1 if lp.trips is None else lp.trips
        _add(total, self.iteration(lp, dynamic=dynamic), times)
      elif inst.opcode == "conditional":
        branches = [self.collectives(c, dynamic=dynamic) for _, c in inst.callees]
        if branches:
          _add(total, max(branches, key=lambda b: sum(b.values())), 1)
      else:
        for role, callee in inst.callees:
          if role in ("calls", "to_apply"):
            _add(total, self.collectives(callee, dynamic=dynamic), 1)
    self._memo[key] = total
    return total

  def iteration(self, lp: Loop, *, dynamic: bool = True) -> dict[str, float]:
    """Bytes by kind of one iteration of a loop: its condition and its body."""
    out: dict[str, float] = {}
    _add(out, self.collectives(lp.condition, dynamic=dynamic), 1)
    _add(out, self.collectives(lp.body, dynamic=dynamic), 1)
    return out

  def dynamic_loops(self) -> list[Loop]:
    """Outermost loops whose trip count depends on data (the decode loops), in program order."""
    found: list[Loop] = []
    seen: set[str] = set()

    def walk(name: str):
      if name in seen or name not in self.comps:
        return
      seen.add(name)
      for inst in self.comps[name].instructions:
        if inst.opcode == "while":
          lp = self.loop(inst)
          if lp.trips is None:
            found.append(lp)
            continue
        for _, callee in inst.callees:
          walk(callee)

    walk(self.entry.name)
    return found

  # ---- tensors ------------------------------------------------------------------------------

  def fused_computations(self) -> set[str]:
    return {callee for c in self.comps.values() for i in c.instructions if i.opcode == "fusion"
            for role, callee in i.callees if role == "calls"}

  def largest_tensors(self, top: int = 5) -> list[dict]:
    """The `top` largest materialised instruction outputs: {shape, bytes, op, op_name}, largest first.

    Tuple outputs count by their largest element; outputs of fused computations' insides, parameters,
    tuples and bitcasts (views) are skipped. Shapes with the same dims are listed once.
    """
    fused = self.fused_computations()
    seen: set[str] = set()
    rows = []
    for comp in self.comps.values():
      if comp.name in fused:
        continue
      for inst in comp.instructions:
        if inst.opcode in _NO_MEMORY or collective_kind(inst.opcode) is None and inst.opcode.endswith("-start"):
          continue
        for dtype, dims in arrays(inst.type):
          nbytes = int(math.prod(dims) * dtype_bytes(dtype))
          rows.append((nbytes, f"{dtype}[{','.join(map(str, dims))}]", inst.opcode, inst.op_name))
    rows.sort(key=lambda r: -r[0])
    out = []
    for nbytes, shape, opcode, op_name in rows:
      if shape in seen:
        continue
      seen.add(shape)
      out.append({"shape": shape, "bytes": nbytes, "op": opcode, "op_name": op_name})
      if len(out) == top:
        break
    return out


def _add(into: dict[str, float], more: dict[str, float], times: float) -> None:
  for k, v in more.items():
    into[k] = into.get(k, 0) + v * times


def summarize(text: str, *, updates: int = 1) -> dict:
  """Collective and tensor figures of one compiled per-chip program.

  Returns {"decode_loops": n, "per_decode_token": {kind: bytes}, "outside_decode": {kind: bytes},
  "per_update": {kind: bytes}, "largest_tensors": [...]}: per decode token is one iteration of the
  most expensive dynamic loop (the sampler decodes in segments, one loop each, the last one
  reading the most cache); outside decode is everything else (prefill, the learner); per update
  divides that by `updates` (the optimizer updates the program makes).
  """
  mod = Module(text)
  loops = mod.dynamic_loops()
  per_token: dict[str, float] = {}
  for lp in loops:
    it = mod.iteration(lp, dynamic=False)
    if sum(it.values()) >= sum(per_token.values()):
      per_token = it
  outside = mod.collectives(dynamic=False)
  return {
      "decode_loops": len(loops),
      "per_decode_token": {k: int(v) for k, v in sorted(per_token.items())},
      "outside_decode": {k: int(v) for k, v in sorted(outside.items())},
      "per_update": {k: int(v / max(updates, 1)) for k, v in sorted(outside.items())},
      "largest_tensors": mod.largest_tensors(),
  }
