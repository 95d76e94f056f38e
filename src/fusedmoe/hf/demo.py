"""`fusedmoe demo --hf FAMILY`: a small random model of a transformers family, patched, checked
against transformers and timed.

    model = build(family, scale)             # MoE tensors redrawn so that they matter
    ref   = model(ids) [eager experts], model(ids) [grouped_mm], greedy generate
    patch(model); out = model(ids), generate  -> relative error, token agreement, speed
"""

from __future__ import annotations

import statistics
import time

import torch

from fusedmoe.hf.families import FAMILIES, family
from fusedmoe.hf.models import build
from fusedmoe.hf.patch import patch

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-2, torch.bfloat16: 5e-2}


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
    hooked = fam.layout not in ("transposed", "dbrx")  # experts classes transformers dispatches
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
    err = ((logits.double() - ref_logits.double()).norm() / ref_logits.double().norm()).item()
    agree = (tokens_out[:, tokens:] == ref_tokens[:, tokens:]).float().mean().item()
    tol = TOLERANCE[dtype]

    print(f"\n  patched      {len(blocks)} MoE blocks ({fam.name}: routing {fam.routing}, "
          f"experts layout {fam.layout})")
    print(f"  logits       rel. error {err:.2e} vs transformers eager "
          f"({'ok' if err < tol else 'TOO LARGE'}, tolerance {tol:.0e})")
    print(f"  generate     {agree:.0%} of {new_tokens} greedy tokens equal")
    base = times.get("transformers eager")
    for label, t in times.items():
        speed = f"  {base / t:.2f}x vs eager" if base else ""
        print(f"  {label:22} {t * 1e3:8.2f} ms per forward (median of {repeats}){speed}")
    return 0 if err < tol else 1
