"""What a compiled XLA program moves and computes, kernel by kernel, read from its optimised HLO text.

A kernel is what XLA:GPU launches: a fusion, a custom call (cuBLAS, a Pallas kernel) or an unfused op that is not
bookkeeping (a copy, a sort, a collective). Per kernel, from the shapes in the text:
  - bytes read: each operand once (a fusion reads its operands once), except an operand the fused computation
    only slices (dynamic-slice, slice, gather, through bitcasts and reshapes: the slices' bytes) and a buffer it
    updates in place (operand 0 of a dynamic-update-slice or scatter: nothing of the rest is read);
  - bytes written: the output, except a buffer updated in place (the update's bytes) and a custom call's
    scratch (a trailing u8/s8 workspace);
  - FLOPs: 2 x output elements x contracted size of every dot (inside a fusion, or a cuBLAS call's
    ``dot_dimension_numbers``).
Bytes are device memory's (HBM): an array whose layout names another memory space (XLA:TPU's ``S(1)`` VMEM,
``S(2)`` SMEM, ...) is on chip and counts nothing, and an async copy between spaces (``copy-start``,
``slice-start``: XLA:TPU's prefetches into VMEM and evictions back) reads what it copies from HBM and writes it
there only when its source or destination is in HBM. So a weight prefetched into VMEM is read once, by its copy,
and the fusion that reads it there reads nothing more.
A Pallas custom call is opaque: its operands count whole, so a kernel that reads a few pages of a large pool is
over-counted (``opaque`` marks it). The expert-tile kernels (``pallas_kernels.expert_tiles``,
``EXPERT_TILE_KERNELS``) are modelled instead: each of their ``grid_x`` tiles reads one expert's slab of each
[E, ., .] weight stack, so a stack counts min(whole, grid_x x whole / E), and their FLOPs are the tiles' rows
(padded) times the slab's (an upper bound: padding tiles skip their reads at run time, and tiles of one expert
share reads through the L2 cache). ``round_kernels`` expands the loops nested in a round (the loop body with the
most kernels of its own, as ``bench.loop_report`` picks it) by their known trip counts.

``roofline``: a model, not a measurement. Each kernel takes max(bytes / bandwidth, FLOPs / peak) and every launch
a fixed cost; ``DEVICES`` holds the constants and where they come from.
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Iterable

# dtype -> bytes per element (HLO's primitive type names)
DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
               "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "s4": 0.5, "u4": 0.5, "f8e4m3fn": 1, "f8e5m2": 1,
               "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "f8e4m3b11fnuz": 1, "f8e4m3": 1, "f8e3m4": 1, "f4e2m1fn": 0.5,
               "f8e8m0fnu": 1, "token": 0}

_COMP = re.compile(r"^(?:ENTRY )?%([\w.\-]+) .*\{$")
_INSTR = re.compile(r"^\s*(ROOT )?%([\w.\-]+) = (\(.*?\)|\S+) ([a-z][\w\-]*)\((.*)$")
_ARRAY = re.compile(r"\b([a-z]+\d*[a-z0-9]*)\[([\d,]*)\](\{[^{}]*\})?")        # dtype, dims, layout
_ON_CHIP = re.compile(r"S\([1-9]\d*\)")            # a layout's memory space other than 0 (device memory)
_BOOKKEEPING = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "conditional", "call",
                "after-all", "partition-id", "replica-id", "iota", "opt-barrier", "add-dependency",
                "call-update"}      # XLA:TPU's async calls (SparseCore gathers): the work is the called computation's
_TRANSPARENT = {"bitcast", "reshape", "copy", "transpose", "convert"}    # a slice behind these still reads a slice
_SLICING = {"dynamic-slice", "slice", "gather"}
_IN_PLACE = {"dynamic-update-slice": 1, "scatter": 2}                       # op -> operand index of the update
_ASYNC_COPIES = {"copy-start": 0, "slice-start": 1}        # op -> element of its output tuple that is the copy
# Pallas kernel name -> operand indices of the expert weight stacks it reads one expert's slab of per tile
EXPERT_TILE_KERNELS = {"expert_tiles_gate_up": (3, 4), "expert_tiles_down": (3,)}


@dataclasses.dataclass(frozen=True)
class Instr:
  name: str
  shape: str
  op: str
  operands: tuple[str, ...]
  attrs: str
  root: bool
  index: int = -1          # a parameter's number


@dataclasses.dataclass(frozen=True)
class Kernel:
  """One launch: ``name`` in the HLO, its ``op`` (fusion, custom-call, ...), ``source`` (the jax op_name it came
  from), bytes read and written, dot FLOPs, ``count`` launches per round (loop trips), ``opaque``: a custom call
  whose reads are its operands' whole sizes (an upper bound)."""
  name: str
  op: str
  source: str
  bytes_read: float
  bytes_written: float
  flops: float
  count: float = 1.0
  opaque: bool = False
  largest_operand: float = 0.0       # bytes of its largest operand (a weight, a cache: what identifies it)

  @property
  def bytes(self) -> float:
    return self.bytes_read + self.bytes_written


@dataclasses.dataclass(frozen=True)
class Device:
  """Roofline constants: HBM ``bandwidth`` (bytes/s), dense bf16 ``peak`` (FLOP/s), ``launch_s`` per kernel;
  ``memory`` (bytes of HBM per device)."""
  name: str
  bandwidth: float
  peak: float
  launch_s: float
  source: str
  memory: float = 0.0


# The launch cost: the one H200 measurement on record (docs/gpu.md, 2026-11-29) had Qwen3-8B's batch-1 AR step at
# 5.11 ms against its 3.4 ms weight-read floor with ~1,100 kernels: (5.11 - 3.4) ms / 1,100 = ~1.5 us per kernel.
LAUNCH_S = 1.5e-6
DEVICES = {
    "h200": Device("H200 SXM", 4.8e12, 989e12, LAUNCH_S, "NVIDIA H200 datasheet: 4.8 TB/s HBM3e, 989 TFLOP/s dense "
                   "bf16; launch cost from the 2026-11-29 H200 AR step", 141e9),
    "h100": Device("H100 SXM", 3.35e12, 989e12, LAUNCH_S, "NVIDIA H100 SXM datasheet: 3.35 TB/s HBM3, 989 TFLOP/s "
                   "dense bf16; launch cost as the H200's", 80e9),
}
# One TPU chip each (public spec sheets); a TPU program is costed whole (its compiled ``cost_analysis()``), with no
# launch cost: XLA:TPU runs a program as one.
TPU_DEVICES = {
    "v5e": Device("TPU v5e", 819e9, 197e12, 0.0, "Google Cloud TPU v5e: 819 GB/s HBM, 197 TFLOP/s bf16, 16 GB", 16e9),
    "v6e": Device("TPU v6e", 1640e9, 918e12, 0.0, "Google Cloud TPU v6e: 1,640 GB/s HBM, 918 TFLOP/s bf16, 32 GB", 32e9),
    "v5p": Device("TPU v5p", 2765e9, 459e12, 0.0, "Google Cloud TPU v5p: 2,765 GB/s HBM, 459 TFLOP/s bf16, 95 GB", 95e9),
}


def array_bytes(shape: str, on_chip: bool = False) -> float:
  """Bytes of every array in an HLO shape string in device memory (a tuple's elements summed; with ``on_chip``
  also those whose layout puts them in another memory space)."""
  return sum(DTYPE_BYTES.get(t, 4) * math.prod(int(d) for d in dims.split(",") if d)
             for t, dims, layout in _ARRAY.findall(shape) if on_chip or not _ON_CHIP.search(layout))


def _elements(shape: str) -> list[str]:
  """The arrays of a shape string, each with its layout."""
  return [m.group(0) for m in _ARRAY.finditer(shape)]


def _dims(shape: str) -> list[int]:
  m = _ARRAY.search(shape)
  return [int(d) for d in m.group(2).split(",") if d] if m else []


def _split_operands(rest: str) -> tuple[list[str], str]:
  """``rest`` after 'opcode(': the top-level operand texts and the attributes after the closing parenthesis."""
  depth, parts, cur = 0, [], []
  for i, ch in enumerate(rest):
    if ch in "([{":
      depth += 1
    elif ch in ")]}":
      if depth == 0 and ch == ")":
        parts.append("".join(cur).strip())
        return [p for p in parts if p], rest[i + 1:]
      depth -= 1
    elif ch == "," and depth == 0:
      parts.append("".join(cur).strip())
      cur = []
      continue
    cur.append(ch)
  return [p for p in parts if p], ""


def parse(hlo: str) -> tuple[dict[str, list[Instr]], str]:
  """{computation: [Instr]} of a compiled HLO module's text, and the entry computation's name."""
  comps, entry, current = {}, None, None
  for line in hlo.splitlines():
    line = re.sub(r"/\*.*?\*/", "", line)
    head = _COMP.match(line)
    if head:
      current = comps.setdefault(head.group(1), [])
      entry = head.group(1) if line.startswith("ENTRY") else entry
      continue
    ins = _INSTR.match(line)
    if ins and current is not None:
      root, name, shape, op, rest = ins.groups()
      operands, attrs = _split_operands(rest)
      names = tuple(m.group(1) for m in (re.search(r"%([\w.\-]+)\s*$", o) for o in operands) if m)
      index = int(operands[0]) if op == "parameter" and operands and operands[0].isdigit() else -1
      current.append(Instr(name, shape, op, names, attrs, bool(root), index))
  return comps, entry


def _source(ins: Instr) -> str:
  m = re.search(r'op_name="([^"]+)"', ins.attrs)
  return m.group(1) if m else "?"


def _called(ins: Instr, key: str) -> str | None:
  m = re.search(rf"\b{key}=%([\w.\-]+)", ins.attrs)
  return m.group(1) if m else None


def _dot_flops(ins: Instr, shapes: dict[str, str]) -> float:
  lhs = _dims(shapes.get(ins.operands[0], "")) if ins.operands else []
  m = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", ins.attrs)
  contracted = [int(d) for d in m.group(1).split(",") if d] if m else []
  return 2.0 * math.prod(_dims(ins.shape)) * math.prod(lhs[d] for d in contracted if d < len(lhs))


def _gemm_flops(ins: Instr, shapes: dict[str, str]) -> float:
  """FLOPs of a cuBLAS custom call from its backend config's dot dimension numbers."""
  m = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', ins.attrs)
  if not m or not ins.operands:
    return 0.0
  lhs = _dims(shapes.get(ins.operands[0], ""))
  contracted = [int(d) for d in re.findall(r'"?(\d+)"?', m.group(1))]
  out = _ARRAY.search(ins.shape)
  out_elems = math.prod(int(d) for d in out.group(2).split(",") if d) if out else 0
  return 2.0 * out_elems * math.prod(lhs[d] for d in contracted if d < len(lhs))


class _Fused:
  """What one fused computation reads of each parameter and writes in place."""

  def __init__(self, instrs: list[Instr]):
    self.by_name = {i.name: i for i in instrs}
    self.users: dict[str, list[Instr]] = {}
    for i in instrs:
      for o in i.operands:
        self.users.setdefault(o, []).append(i)
    self.root = next((i for i in instrs if i.root), instrs[-1] if instrs else None)

  def read_bytes(self, name: str) -> float | None:
    """Bytes read of value ``name`` when every use only slices it (through transparent ops), else None."""
    total = 0.0
    for u in self.users.get(name, []):
      if u.op in _SLICING and u.operands and u.operands[0] == name:
        total += array_bytes(u.shape)
      elif u.op in _IN_PLACE and u.operands and u.operands[0] == name:
        continue                                           # the buffer updated in place: nothing of it read
      elif u.op in _TRANSPARENT:
        inner = self.read_bytes(u.name)
        if inner is None:
          return None
        total += inner
      else:
        return None
    return total

  def written_bytes(self, ins: Instr) -> float:
    """Bytes the value ``ins`` writes: an in-place update's update, a tuple's elements, else its shape."""
    if ins.op in _IN_PLACE:
      return array_bytes(self.by_name[ins.operands[_IN_PLACE[ins.op]]].shape) if len(ins.operands) > \
          _IN_PLACE[ins.op] and ins.operands[_IN_PLACE[ins.op]] in self.by_name else array_bytes(ins.shape)
    if ins.op == "tuple":
      return sum(self.written_bytes(self.by_name[o]) for o in ins.operands if o in self.by_name)
    if ins.op in ("bitcast", "reshape") and ins.operands and ins.operands[0] in self.by_name:
      inner = self.by_name[ins.operands[0]]
      if inner.op in _IN_PLACE or inner.op == "tuple":
        return self.written_bytes(inner)
    return array_bytes(ins.shape)


def _kernel(ins: Instr, comps: dict[str, list[Instr]], shapes: dict[str, str], count: float) -> Kernel:
  k = _kernel_costs(ins, comps, shapes, count)
  return dataclasses.replace(k, largest_operand=max((array_bytes(shapes.get(o, "")) for o in ins.operands),
                                                    default=0.0))


def _kernel_costs(ins: Instr, comps: dict[str, list[Instr]], shapes: dict[str, str], count: float) -> Kernel:
  source = _source(ins)
  operand_bytes = [array_bytes(shapes.get(o, "")) for o in ins.operands]
  if ins.op == "fusion":
    fused_name = _called(ins, "calls")
    fused = _Fused(comps.get(fused_name, []))
    if source == "?":                  # a fusion printed without metadata: its fused root's
      source = next((_source(i) for i in reversed(comps.get(fused_name, [])) if _source(i) != "?"), "?")
    params = {i.index: i.name for i in comps.get(fused_name, []) if i.op == "parameter"}
    read = 0.0
    for k, b in enumerate(operand_bytes):
      p = params.get(k)
      sliced = fused.read_bytes(p) if p else None
      read += b if sliced is None or b == 0 else sliced              # b == 0: the operand is on chip
    written = min(fused.written_bytes(fused.root), array_bytes(ins.shape)) if fused.root else array_bytes(ins.shape)
    flops = sum(_dot_flops(i, {j.name: j.shape for j in comps.get(fused_name, [])})
                for i in comps.get(fused_name, []) if i.op in ("dot", "convolution"))
    return Kernel(ins.name, "fusion", source, read, written, flops, count)
  if ins.op == "custom-call":
    target = re.search(r'custom_call_target="([^"]+)"', ins.attrs)
    target = target.group(1) if target else "?"
    out = [array_bytes(e) for e in _elements(ins.shape)]
    if len(out) > 1 and re.search(r"\b[su]8\[[\d,]*\]\s*\)?\s*$", ins.shape.strip()):
      out = out[:-1]                                              # cuBLAS / cuDNN workspace
    gemm = "cublas" in target or "gemm" in target
    flops = _gemm_flops(ins, shapes) if gemm else 0.0
    tiles = next((EXPERT_TILE_KERNELS[n] for n in EXPERT_TILE_KERNELS if f"/{n}/" in source), None)
    grid = re.search(r"\bgrid_x = (\d+)", ins.attrs)
    if tiles is not None and grid:
      rows = math.prod(_dims(ins.shape)[:-1])                     # tiles x rows per tile (padded)
      for i in tiles:
        experts, contracted, cols = _dims(shapes.get(ins.operands[i], ""))
        operand_bytes[i] = min(operand_bytes[i], int(grid.group(1)) * operand_bytes[i] / experts)
        flops += 2.0 * rows * contracted * cols
    return Kernel(ins.name, f"custom-call:{target}", source, sum(operand_bytes), sum(out), flops, count,
                  opaque=not gemm and not (tiles is not None and grid))
  if ins.op in _SLICING or ins.op in _ASYNC_COPIES:
    copy = _elements(ins.shape)[_ASYNC_COPIES.get(ins.op, 0)]
    from_memory = bool(ins.operands) and array_bytes(shapes.get(ins.operands[0], "")) > 0
    return Kernel(ins.name, ins.op, source, array_bytes(copy, on_chip=True) if from_memory else 0.0,
                  array_bytes(copy), 0.0, count)
  if ins.op in _IN_PLACE:
    upd = ins.operands[_IN_PLACE[ins.op]] if len(ins.operands) > _IN_PLACE[ins.op] else None
    b = array_bytes(shapes.get(upd, "")) if upd else array_bytes(ins.shape)
    return Kernel(ins.name, ins.op, source, b, b, 0.0, count)
  flops = _dot_flops(ins, shapes) if ins.op == "dot" else 0.0
  return Kernel(ins.name, ins.op, source, sum(operand_bytes), array_bytes(ins.shape), flops, count)


def _trips(ins: Instr) -> float | None:
  m = re.search(r'"known_trip_count":\{"n":"(\d+)"', ins.attrs)
  return float(m.group(1)) if m else None


def kernels_of(comps: dict[str, list[Instr]], name: str, count: float = 1.0, unknown_trips: float = 1.0,
               seen: tuple[str, ...] = ()) -> list[Kernel]:
  """Every kernel computation ``name`` launches, loops expanded by their known trip counts (``unknown_trips``
  otherwise), a conditional's branches each at ``count`` (an upper bound: one runs)."""
  if name in seen or name not in comps:
    return []
  shapes = {i.name: i.shape for i in comps[name]}
  out: list[Kernel] = []
  for ins in comps[name]:
    if ins.op == "while":
      trips = _trips(ins)
      trips = unknown_trips if trips is None else trips
      out += kernels_of(comps, _called(ins, "body"), count * trips, unknown_trips, seen + (name,))
      out += kernels_of(comps, _called(ins, "condition"), count * (trips + 1), unknown_trips, seen + (name,))
    elif ins.op == "conditional":
      branches = re.search(r"branch_computations=\{([^}]*)\}", ins.attrs)
      names = re.findall(r"%([\w.\-]+)", branches.group(1)) if branches else [
          c for c in (_called(ins, "true_computation"), _called(ins, "false_computation")) if c]
      for b in names:
        out += kernels_of(comps, b, count, unknown_trips, seen + (name,))
    elif ins.op == "call" or ins.op.startswith("async") or ins.op.endswith("-start"):
      callee = _called(ins, "to_apply") or _called(ins, "calls")
      if callee:
        out += kernels_of(comps, callee, count, unknown_trips, seen + (name,))
      if ins.op.endswith("-start") and not callee:
        out.append(_kernel(ins, comps, shapes, count))
    elif ins.op in _BOOKKEEPING or ins.op.endswith("-done"):
      continue
    else:
      out.append(_kernel(ins, comps, shapes, count))
  return out


def _loop_bodies(comps, name: str, seen: set) -> list[str]:
  found = []
  if name in seen or name not in comps:
    return found
  seen.add(name)
  for ins in comps[name]:
    if ins.op == "while":
      found.append(_called(ins, "body"))
    for key in ("body", "condition", "to_apply", "calls", "true_computation", "false_computation"):
      c = _called(ins, key)
      if c and (ins.op in ("while", "conditional", "call") or ins.op.startswith("async")):
        found += _loop_bodies(comps, c, seen)
    branches = re.search(r"branch_computations=\{([^}]*)\}", ins.attrs)
    for c in re.findall(r"%([\w.\-]+)", branches.group(1)) if branches else []:
      found += _loop_bodies(comps, c, seen)
  return found


def scoped_loop_bodies(comps: dict[str, list[Instr]], scope: str) -> list[str]:
  """Bodies of the while loops jax traced inside the named scope ``scope`` (op_name ending '<scope>/while'), in
  program order (each computation's instructions in text order)."""
  return [_called(i, "body") for instrs in comps.values() for i in instrs
          if i.op == "while" and re.search(rf'op_name="[^"]*{re.escape(scope)}/while"', i.attrs)]


def unknown_trip_loops(comps: dict[str, list[Instr]], name: str, seen: tuple[str, ...] = ()) -> int:
  """While loops reached from computation ``name`` without a known trip count (``kernels_of`` counts each once)."""
  if name in seen or name not in comps:
    return 0
  n = 0
  for ins in comps[name]:
    if ins.op == "while" and _trips(ins) is None:
      n += 1
    for key in ("body", "condition", "to_apply", "calls", "true_computation", "false_computation"):
      c = _called(ins, key)
      if c and ins.op != "fusion":
        n += unknown_trip_loops(comps, c, seen + (name,))
    branches = re.search(r"branch_computations=\{([^}]*)\}", ins.attrs)
    for c in re.findall(r"%([\w.\-]+)", branches.group(1)) if branches else []:
      n += unknown_trip_loops(comps, c, seen + (name,))
  return n


def round_body(hlo: str, scope: str | None = None, variant: int = 0) -> tuple[dict[str, list[Instr]], str]:
  """(parsed module, the computation of one round): the ``variant``-th loop body in ``scope`` (the engine's
  ``ROUND_BODIES``: variant 0 decodes at the first key length without prefill lanes, 1 adds the lanes), else the
  loop body with the most kernels of its own, else the entry (a program without loops)."""
  comps, entry = parse(hlo)
  scoped = scoped_loop_bodies(comps, scope) if scope else []
  if scoped:
    return comps, scoped[min(variant, len(scoped) - 1)]
  bodies = list(dict.fromkeys(_loop_bodies(comps, entry, set())))
  own = lambda b: sum(1 for i in comps[b] if i.op not in _BOOKKEEPING and not i.op.endswith("-done"))
  return comps, max(bodies, key=own, default=entry)


def round_kernels(hlo: str, scope: str | None = None, variant: int = 0) -> list[Kernel]:
  """The kernels one round launches (``round_body``), nested loops expanded by their trip counts."""
  comps, body = round_body(hlo, scope, variant)
  return kernels_of(comps, body)


def totals(kernels: Iterable[Kernel]) -> dict:
  """Sums per round: launches, bytes read / written, FLOPs, opaque launches."""
  ks = list(kernels)
  return {"kernels": sum(k.count for k in ks), "bytes_read": sum(k.bytes_read * k.count for k in ks),
          "bytes_written": sum(k.bytes_written * k.count for k in ks), "flops": sum(k.flops * k.count for k in ks),
          "opaque_kernels": sum(k.count for k in ks if k.opaque)}


def roofline(kernels: Iterable[Kernel], device: Device) -> dict:
  """The model's time per round: per kernel max(bytes / bandwidth, FLOPs / peak), summed, plus launches x the
  launch cost; with the bytes-only and FLOPs-only floors."""
  ks = list(kernels)
  per = sum(max(k.bytes / device.bandwidth, k.flops / device.peak) * k.count for k in ks)
  launches = sum(k.count for k in ks)
  t = totals(ks)
  return {"device": device.name, "time_s": per + launches * device.launch_s, "kernel_time_s": per,
          "launch_time_s": launches * device.launch_s, "bytes_floor_s": (t["bytes_read"] + t["bytes_written"]) /
          device.bandwidth, "flops_floor_s": t["flops"] / device.peak}


def by_source(kernels: Iterable[Kernel], depth: int = 4) -> dict[str, float]:
  """Bytes per round grouped by the first ``depth`` parts of the kernels' jax op_name."""
  out: dict[str, float] = {}
  for k in kernels:
    key = "/".join(k.source.split("/")[:depth])
    out[key] = out.get(key, 0.0) + k.bytes * k.count
  return out


def to_json(kernels: Iterable[Kernel]) -> list[dict]:
  return [dataclasses.asdict(k) for k in kernels]

