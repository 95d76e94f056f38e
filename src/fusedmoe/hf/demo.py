"""`fusedmoe demo --hf FAMILY`: a small random model of a transformers family, patched, checked
against transformers and timed.

    model = build(family, scale)             # MoE tensors redrawn so that they matter
    ref   = model(ids) [eager experts], model(ids) [grouped_mm], greedy generate
    patch(model); out = model(ids), generate  -> relative error, token agreement, speed
In float32 the patched logits must equal transformers' within 1e-5. In bf16/fp16 both are held to
the same model in float32: the patched model passes when it is as close as transformers' own
(a rounding difference may flip a near-tie routing decision, so bf16 runs are not compared with
each other directly).
"""

from __future__ import annotations

import statistics
import time

import torch

from fusedmoe.hf.families import FAMILIES, family
from fusedmoe.hf.layouts import LAYOUTS
from fusedmoe.hf.models import build
from fusedmoe.hf.patch import patch

FP32_TOLERANCE = 1e-5


def list_families() -> str:
    lines = []
    for f in FAMILIES:
        status = f"refused: {f.refused}" if f.refused else f"routing={f.routing}, layout={f.layout}"
        lines.append(f"{f.model_type:20} {f.name:20} {status}")
    return "\n".join(lines)


def _time(fn, device: torch.device, repeats: int) -> float:
    fn()  # warm-up (first-call compilation, allocator)
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run_demo(name: str, *, tokens: int, new_tokens: int, dtype: torch.dtype, device: torch.device,
             scale: int) -> int:
    fam = family(name)
    if fam.refused:
        print(f"fusedmoe demo --hf {name}: {fam.name} is not supported: {fam.refused}")
        return 2
    model = build(fam, scale=scale, dtype=dtype, device=device)
    config = model.config.get_text_config()
    print(f"fusedmoe demo --hf {fam.model_type}: {fam.name}, random weights, {type(model).__name__}")
    print(f"  hidden={config.hidden_size} layers={config.num_hidden_layers} tokens={tokens} "
          f"new_tokens={new_tokens} dtype={str(dtype).replace('torch.', '')} device={device}")
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (1, tokens), generator=gen).to(device)
    mask = torch.ones_like(ids)
    repeats = 3 if device.type == "cpu" else 20

    def forward():
        with torch.no_grad():
            return model(ids).logits

    def generate():
        with torch.no_grad():
            return model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                                  pad_token_id=0)

    times = {}
    hooked = LAYOUTS[fam.layout].dispatched  # experts classes transformers dispatches
    if hooked:
        for impl in ("eager", "grouped_mm"):
            try:
                model.set_experts_implementation(impl)
            except (ValueError, ImportError) as exc:  # grouped_mm needs a recent torch / GPU
                print(f"  (transformers {impl} not available: {exc})")
                continue
            times[f"transformers {impl}"] = _time(forward, device, repeats)
        model.set_experts_implementation("eager")
    else:
        times["transformers eager"] = _time(forward, device, repeats)
    ref_logits = forward()
    ref_tokens = generate()

    blocks = patch(model)
    times["fusedmoe patch"] = _time(forward, device, repeats)
    logits = forward()
    tokens_out = generate()
    err = _rel_err(logits, ref_logits)
    agree = (tokens_out[:, tokens:] == ref_tokens[:, tokens:]).float().mean().item()
    if dtype == torch.float32:
        ok, verdict = err < FP32_TOLERANCE, f"tolerance {FP32_TOLERANCE:.0e}"
    else:
        with torch.no_grad():
            want = build(fam, scale=scale, device=device)(ids).logits
        ours, theirs = _rel_err(logits, want), _rel_err(ref_logits, want)
        ok = ours <= 1.5 * theirs + 1e-3
        verdict = f"vs float32: patched {ours:.2e}, transformers {theirs:.2e}"

    print(f"\n  patched      {len(blocks)} MoE blocks ({fam.name}: routing {fam.routing}, "
          f"experts layout {fam.layout})")
    print(f"  logits       rel. error {err:.2e} vs transformers eager "
          f"({'ok' if ok else 'TOO LARGE'}, {verdict})")
    print(f"  generate     {agree:.0%} of {new_tokens} greedy tokens equal")
    base = times.get("transformers eager")
    for label, t in times.items():
        speed = f"  {base / t:.2f}x vs eager" if base else ""
        print(f"  {label:22} {t * 1e3:8.2f} ms per forward (median of {repeats}){speed}")
    return 0 if ok else 1


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()
