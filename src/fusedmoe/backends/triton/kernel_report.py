"""Compile the Triton kernels a call would launch for a GPU, on any machine (no GPU needed).

    with recording() as calls:                      # every jitted kernel of kernels.py and
        triton_experts(x, w13, w2, ..., tiles=...)  # quant_kernels.py records its launch instead
    for call in calls:
        compiled = compile_call(call)               # triton.compile for GPUTarget("cuda", 90, 32)
        usage(compiled)                             # registers, spill stack, shared memory, SASS

What a launch on an H100/H200 would compile: the recorded arguments are typed and specialised as
Triton's launcher does (ints of 1 and None as constexprs, 16-divisible ints and 16-byte aligned
tensors marked divisible), so the PTX, ptxas' register allocation and the SASS are the GPU's, for
the Triton and ptxas of this machine (a GPU with another Triton version compiles differently).
Needs Triton's CUDA backend (ptxas, cuobjdump ship with the wheel); run without TRITON_INTERPRET
(under the interpreter @triton.jit functions cannot be compiled). `benchmarks/kernel_report.py`
prints a preset's kernels; `tests/tma_compile.py` checks the descriptor loads.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import re
import subprocess
import tempfile
from collections import Counter
from dataclasses import dataclass

import torch

TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32",
         torch.int64: "i64", torch.int8: "i8", torch.uint8: "u8", torch.int16: "i16",
         torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5"}


@dataclass
class Call:
    """One recorded launch: the kernel (a JITFunction), its grid and arguments."""

    name: str
    fn: object
    grid: tuple
    args: tuple
    kwargs: dict


class _Recorder:
    """Stands in for a jitted kernel: `kernel[grid](*args, **kwargs)` records the call (and, with
    `run`, launches it)."""

    def __init__(self, name: str, fn, calls: list[Call], run: bool):
        self.name, self.fn, self.calls, self.run = name, fn, calls, run

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.calls.append(Call(self.name, self.fn, tuple(grid), args, kwargs))
            if self.run:
                self.fn[grid](*args, **kwargs)
        return launch


@contextlib.contextmanager
def recording(run: bool = False, only: tuple[str, ...] | None = None):
    """Replace every jitted kernel of `kernels`, `quant_kernels` and `routing` (or those named in
    `only`) with a recorder; yields the list the launches are appended to. Nothing runs (outputs stay as
    allocated) unless `run`: then each launch runs too, so the recorded tensors hold what the call
    computed (benchmarks/bench_row_stationary.py times a recorded GEMM2 beside variants on its
    tensors). Running needs `only` to name launched kernels: a jitted helper replaced by a recorder
    could not be called from a kernel."""
    if run and only is None:
        raise ValueError("recording(run=True) needs `only`: the kernels to record (their helpers must stay jitted)")
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    from fusedmoe.backends.triton import kernels, quant_kernels, routing

    calls: list[Call] = []
    saved = []
    for module in (kernels, quant_kernels, routing):
        for name, fn in vars(module).items():
            if isinstance(fn, (JITFunction, InterpretedFunction)) and (only is None or name in only):
                saved.append((module, name, fn))
                setattr(module, name, _Recorder(name, fn, calls, run))
    try:
        yield calls
    finally:
        for module, name, fn in saved:
            setattr(module, name, fn)


def source(call: Call):
    """(ASTSource, compile options) of a recorded launch, specialised as Triton's launcher would."""
    from triton.compiler import ASTSource
    from triton.tools.tensor_descriptor import TensorDescriptor

    kwargs = dict(call.kwargs)
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages", "maxnreg") if k in kwargs}
    if kwargs.pop("launch_pdl", False):
        options["launch_pdl"] = True
    bound = inspect.signature(call.fn.fn).bind(*call.args, **kwargs)
    bound.apply_defaults()
    constexpr = [p.is_constexpr for p in call.fn.params]
    signature, constants, attrs = {}, {}, {}
    for i, (name, value) in enumerate(bound.arguments.items()):
        if constexpr[i] or value is None or (type(value) is int and value == 1):
            signature[name] = "constexpr"
            constants[(i,)] = value
        elif isinstance(value, TensorDescriptor):
            signature[name] = f"tensordesc<{TYPES[value.base.dtype]}[{', '.join(map(str, value.block_shape))}]>"
        elif isinstance(value, torch.Tensor):
            signature[name] = "*" + TYPES[value.dtype]
            if value.data_ptr() % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[name] = "fp32"
        elif isinstance(value, bool):
            signature[name] = "i1"
        else:
            signature[name] = "i32" if -2**31 <= value < 2**31 else "i64"
            if value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return ASTSource(call.fn, signature, constants, attrs), options


def compile_call(call: Call, capability: int = 90):
    """triton.compile of a recorded launch for GPUTarget("cuda", capability, 32)."""
    import triton
    from triton.backends.compiler import GPUTarget

    src, options = source(call)
    return triton.compile(src, target=GPUTarget("cuda", capability, 32), options=options)


def _tool(name: str) -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


# SASS opcodes worth counting in a GEMM: tensor-core MMAs, global / shared / TMA traffic, barriers,
# byte permutes and LOP3s (the weight decodes), fp32 FMAs / multiplies (scaling).
OPCODES = ("HGMMA", "HMMA", "IMMA", "QGMMA", "LDG", "STG", "LDGSTS", "UTMALDG", "LDS", "STS", "LDSM",
           "BAR", "SYNCS", "WARPGROUP", "PRMT", "LOP3", "FFMA", "FMUL", "HFMA2", "F2FP", "I2F")


def usage(compiled) -> dict:
    """{regs, stack (bytes per thread: spills), shared (bytes, dynamic + static), instructions,
    opcodes (counts of `OPCODES` by prefix), all_opcodes (every opcode's count, modifiers
    dropped), loop (`loop_mix`)} from the cubin (cuobjdump); from the TTGIR, wgmma_dots (warpgroup
    MMAs), wgmma_rs (those whose A operand is a register tile) and wgmma_waits (each wait's count
    of MMAs it leaves in flight: all 0 where every MMA is waited for where it is issued, as
    kernels._rs_sync makes the fragment GEMMs' dots)."""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        res = subprocess.run([_tool("cuobjdump"), "-res-usage", path], capture_output=True, text=True,
                             check=True).stdout
        sass = subprocess.run([_tool("cuobjdump"), "-sass", path], capture_output=True, text=True,
                              check=True).stdout
    fields = dict(re.findall(r"(\w+(?:\[\d+\])?):(\d+)", res))
    ttgir = compiled.asm.get("ttgir", "")
    ops = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", sass)
    counts = Counter(op.split(".")[0] for op in ops)
    return {
        "regs": int(fields.get("REG", 0)),
        "stack": int(fields.get("STACK", 0)),
        "shared": int(fields.get("SHARED", 0)) + int(compiled.metadata.shared),
        "instructions": len(ops),
        "opcodes": {p: sum(n for op, n in counts.items() if op.startswith(p)) for p in OPCODES},
        "all_opcodes": dict(counts.most_common()),
        "loop": loop_mix(sass),
        "wgmma_dots": len(re.findall(r"ttng\.warp_group_dot ", ttgir)),
        "wgmma_rs": len(re.findall(r"ttng\.warp_group_dot [^\n]* : tensor<", ttgir)),
        "wgmma_waits": [int(n) for n in re.findall(r"ttng\.warp_group_dot_wait[^{\n]*\{pendings = (\d+)", ttgir)],
        "asm_pack": asm_pack_hazards(ttgir),
    }


def programs_per_sm(regs: int, threads: int, shared: int) -> int:
    """Programs of a kernel resident on one sm90 SM: registers are allocated 8 a thread at a time
    (256 a warp) out of 65536, and each program's shared memory comes with the 1 KiB the driver
    reserves, out of the SM's 228 KiB; at most 32 programs."""
    by_regs = 65536 // max(1, -(-regs // 8) * 8 * threads)
    return min(32, by_regs, 228 * 1024 // (shared + 1024))


def plain_ttgir(text: str) -> str:
    """TTGIR without its source locations and with every SSA value named %v: two trees' kernels
    that compile to the same code give the same text (whatever their variables are called)."""
    text = re.sub(r"^#loc.*\n", "", text, flags=re.M)
    text = re.sub(r" ?loc\((?:[^()]|\([^()]*\))*\)", "", text)
    return re.sub(r"%[A-Za-z_0-9#]+", "%v", text)


def _layouts(ttgir: str) -> dict[str, tuple[str, dict]]:
    """The TTGIR's #blocked / #linear layout aliases: name -> (kind, fields: lists of ints or of
    int lists)."""
    out = {}
    for name, kind, body in re.findall(r"^#(\w+) = #ttg\.(blocked|linear)<\{(.*)\}>", ttgir, re.M):
        out[name] = (kind, {k: json.loads(v) for k, v in re.findall(r"(\w+) = (\[[^=]*\])(?:,|$)", body)})
    return out


def cross_element_asm() -> tuple[str, ...]:
    """The inline asm bodies whose packed elements are not independent: the 4-bit fragment
    decodes, which read a call's 4 packed bytes as one word whose nibbles belong to other elements
    (kernels.W4_PTX_FRAG / W4_PTX_I4FRAG / W4_PTX_I4FRAG_ZP). The others (the checkpoint layout's
    decodes, a byte to its two nibbles; the scale multipliers) map each element to its own."""
    from fusedmoe.backends.triton import kernels

    return tuple(getattr(kernels, name).value for name in ("W4_PTX_FRAG", "W4_PTX_I4FRAG", "W4_PTX_I4FRAG_ZP"))


def asm_pack_hazards(ttgir: str, bodies: tuple[str, ...] | None = None) -> list[str]:
    """Inline asm ops of `bodies` (default `cross_element_asm`) packing P elements per call
    (`tl.inline_asm_elementwise(..., pack=P)`) whose operands' layout does not give each thread P
    consecutive elements of the last dimension as its first registers. Triton hands an asm call a
    thread's next P registers, whatever elements they hold, so such a decode reads the wrong codes.
    H200, Triton 3.6: the fragment decode with its scales loaded once a row group for int4 g64 /
    g128 (registers holding elements 0, 1, 4, 5) and mxfp4 (0, 4, 1, 5) computed wrong results,
    and each shows here (results/2026-11-30_h200_ff93a3e_int4_lane_tile.txt). Only #blocked and
    #linear operands are checked."""
    bodies = cross_element_asm() if bodies is None else bodies
    layouts = _layouts(ttgir)
    out = []
    for body, pack, types in re.findall(r'tt\.elementwise_inline_asm "((?:[^"\\]|\\.)*)" \{[^}]*?'
                                        r'packed_element = (\d+) : i32[^}]*\} [^:]*: (.*?) ->', ttgir):
        pack = int(pack)
        if pack < 2 or body.replace("\\0A", "\n") not in bodies:
            continue
        for shape, name in re.findall(r"tensor<([\dx]+)x\w+, #(\w+)>", types):
            if name not in layouts:
                continue
            rank = len(shape.split("x"))
            kind, f = layouts[name]
            if kind == "blocked":
                ok = f["order"][0] == rank - 1 and f["sizePerThread"][-1] % pack == 0
            else:
                unit = [[0] * (rank - 1) + [1 << i] for i in range(pack.bit_length() - 1)]
                ok = f.get("register", [])[:len(unit)] == unit
            if not ok:
                out.append(f"asm packing {pack} on tensor<{shape}> #{name} {kind} "
                           f"{f.get('register', f.get('sizePerThread'))}: not {pack} consecutive elements a call")
    return sorted(set(out))


def loop_mix(sass: str) -> dict:
    """{instructions, opcodes (all, by count)} of the longest loop in a SASS listing: the span from
    a backward branch's target to the branch (a GEMM's K loop, whose body is the instructions issued
    per K step; 0 and {} without one)."""
    lines = re.findall(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);", sass)
    index = {int(addr, 16): i for i, (addr, _, _) in enumerate(lines)}
    spans = []
    for i, (addr, op, rest) in enumerate(lines):
        target = re.search(r"0x([0-9a-f]+)", rest) if op.startswith("BRA") else None
        if target and int(target.group(1), 16) < int(addr, 16) and int(target.group(1), 16) in index:
            spans.append((index[int(target.group(1), 16)], i))
    if not spans:
        return {"instructions": 0, "opcodes": {}}
    start, end = max(spans, key=lambda s: s[1] - s[0])
    body = Counter(op.split(".")[0] for _, op, _ in lines[start:end + 1])
    return {"instructions": end - start + 1, "opcodes": dict(body.most_common())}


def loop_hazards(loop: dict) -> list[str]:
    """What in a K loop's mix (`loop_mix`) is known to cost time: register spills in the loop
    (local loads / stores: LDL, STL), and wgmma waited on one instruction at a time (WARPGROUP
    arrive / wait at least twice per MMA and 16 or more: a pipelined K step has ~4-9 per step
    whatever its MMA count; ptxas serializes the wgmma where the operands in registers outgrow the
    file, as the 4-bit fragment GEMM1's 64 x 128 x 128 tile at 4 warps did: 64 for 32 HGMMA).
    Read against the compiling Triton: under Triton 3.9 (the CPU machine) the serialized pattern
    marked those tiles alone, while under 3.6 (the H200's) every 4-bit K loop, 16-row tiles too,
    shows two WARPGROUP per HGMMA, so there only the spills tell tiles apart
    (results/2026-11-29_h200_efb440d_w4_block_k_ab.txt)."""
    ops = loop.get("opcodes", {})
    out = []
    spills = {k: ops[k] for k in ("LDL", "STL") if ops.get(k)}
    if spills:
        out.append("spills in the loop (" + ", ".join(f"{k} {v}" for k, v in spills.items()) + ")")
    hgmma, waits = ops.get("HGMMA", 0) + ops.get("QGMMA", 0) + ops.get("IGMMA", 0), ops.get("WARPGROUP", 0)
    if hgmma and waits >= max(16, 2 * hgmma):
        out.append(f"wgmma serialized ({waits} WARPGROUP for {hgmma} MMA)")
    return out


def unavailable() -> str | None:
    """Why this machine cannot compile for sm90 (no CUDA backend, no ptxas, the interpreter on),
    or None."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "TRITON_INTERPRET=1: jitted functions run in the interpreter, not compiled"
    try:
        import triton
        import triton.language as tl
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource

        @triton.jit
        def _copy(src_ptr, dst_ptr, BLOCK: tl.constexpr):
            offs = tl.arange(0, BLOCK)
            tl.store(dst_ptr + offs, tl.load(src_ptr + offs))

        src = ASTSource(_copy, {"src_ptr": "*fp32", "dst_ptr": "*fp32", "BLOCK": "constexpr"}, {(2,): 16})
        usage(triton.compile(src, target=GPUTarget("cuda", 90, 32)))
    except Exception as exc:  # the reason is the report: callers skip with it
        return f"{type(exc).__name__}: {exc}"[:300]
    return None
