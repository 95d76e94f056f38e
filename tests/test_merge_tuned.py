"""scripts/merge_tuned.py: a GPU session's tuned entries into a packaged table, without a GPU."""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
_spec = importlib.util.spec_from_file_location("merge_tuned", ROOT / "scripts" / "merge_tuned.py")
merge_tuned = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(merge_tuned)

PACKAGED = json.loads((ROOT / "src/fusedmoe/backends/triton/tuned/NVIDIA_H200.json").read_text())


def _table(entries: list[dict], **meta) -> dict:
    return {"format": 3, "device": "NVIDIA H200", "triton": "3.6.0", "torch": "2.11.0+cu130",
            "date": "2026-11-01", "entries": entries, **meta}


def _entry(tokens: int, us: float, quant: str = "mxfp4_w4a16") -> dict:
    e = copy.deepcopy(next(e for e in PACKAGED["entries"] if e.get("quant") == quant and e["tokens"] >= 256))
    e.update(tokens=tokens, us=us)
    return e


def test_entries_replace_their_key_and_add_the_rest(tmp_path, capsys):
    into, new = tmp_path / "NVIDIA_H200.json", tmp_path / "new.json"
    kept, old256 = _entry(1024, 50.0), _entry(256, 40.0)
    into.write_text(json.dumps(_table([kept, old256])))
    new.write_text(json.dumps(_table([_entry(256, 30.0), _entry(4096, 90.0)], date="2026-11-30")))
    assert merge_tuned.main([str(new), "--into", str(into), "--dry-run"]) == 0
    assert "would merge 2 entries" in capsys.readouterr().out
    assert json.loads(into.read_text())["entries"] == [kept, old256]  # a dry run writes nothing
    assert merge_tuned.main([str(new), "--into", str(into)]) == 0
    out = capsys.readouterr().out
    assert "merged 2 entries" in out and "1 replaced, 1 added" in out and "4096)" in out
    merged = json.loads(into.read_text())
    assert sorted((e["tokens"], e["us"]) for e in merged["entries"]) == [(256, 30.0), (1024, 50.0), (4096, 90.0)]
    assert merged["triton"] == "3.6.0" and merged["date"] != "2026-11-01"


@pytest.mark.parametrize(("meta", "why"), [
    ({"device": "NVIDIA H100 80GB HBM3"}, "was tuned on 'NVIDIA H100 80GB HBM3'"),
    ({"triton": "3.7.1"}, "was tuned under Triton 3.7.1"),
    ({"format": 99}, "not a fusedmoe tuned table"),
])
def test_a_table_of_another_device_or_triton_is_refused(tmp_path, capsys, meta, why):
    into, new = tmp_path / "NVIDIA_H200.json", tmp_path / "new.json"
    into.write_text(json.dumps(_table([_entry(256, 40.0)])))
    before = into.read_text()
    new.write_text(json.dumps(_table([_entry(256, 30.0)], **meta)))
    assert merge_tuned.main([str(new), "--into", str(into)]) == 2
    assert why in capsys.readouterr().err
    assert into.read_text() == before


def test_an_invalid_entry_is_refused(tmp_path, capsys):
    into, new = tmp_path / "NVIDIA_H200.json", tmp_path / "new.json"
    into.write_text(json.dumps(_table([])))
    bad = _entry(256, 30.0)
    bad["gemm1"] = [64, 128]
    new.write_text(json.dumps(_table([bad])))
    assert merge_tuned.main([str(new), "--into", str(into)]) == 2
    assert "entry 0" in capsys.readouterr().err


def _mixtral(tokens: int, quant: str = "mxfp4_w4a16") -> dict:
    e = copy.deepcopy(next(e for e in PACKAGED["entries"] if e.get("quant") == quant and e["experts"] == 8
                           and e["hidden"] == 4096 and e["inter"] == 14336))
    e["tokens"] = tokens
    return e


def test_drop_removes_a_presets_entries_at_one_token_count(tmp_path, capsys):
    """--drop QUANT:PRESET:TOKENS removes exactly the entries serving the preset's bench shape at that
    token count (before a merge, with one); a dry run writes nothing; a spec that matches nothing,
    or names no scheme, preset or count, exits 2 naming it and leaves the table alone."""
    into, new = tmp_path / "NVIDIA_H200.json", tmp_path / "new.json"
    m16, m256, other = _mixtral(16), _mixtral(256), _entry(256, 40.0, quant="nvfp4_w4a16")
    into.write_text(json.dumps(_table([m16, m256, other])))
    before = into.read_text()
    assert merge_tuned.main(["--drop", "mxfp4_w4a16:mixtral-8x7b:256", "--into", str(into), "--dry-run"]) == 0
    assert "1 dropped" in capsys.readouterr().out and into.read_text() == before
    for spec, why in (("mxfp4_w4a16:mixtral-8x7b:512", "no entry of"), ("mxfp9:mixtral-8x7b:16", "unknown scheme"),
                      ("mxfp4_w4a16:mixtral:16", "unknown model preset"), ("mxfp4_w4a16:mixtral-8x7b:x", "positive integer"),
                      ("mxfp4_w4a16:mixtral-8x7b", "QUANT:PRESET:TOKENS")):
        assert merge_tuned.main(["--drop", spec, "--into", str(into)]) == 2, spec
        assert why in capsys.readouterr().err and into.read_text() == before
    new.write_text(json.dumps(_table([_mixtral(4096)], date="2026-11-30")))
    assert merge_tuned.main([str(new), "--drop", "mxfp4_w4a16:mixtral-8x7b:256", "--into", str(into)]) == 0
    out = capsys.readouterr().out
    assert "0 replaced, 1 added, 1 dropped" in out and "dropped: ('mxfp4_w4a16'" in out
    kept = json.loads(into.read_text())["entries"]
    assert sorted((e.get("quant"), e["tokens"]) for e in kept) == sorted(
        [("mxfp4_w4a16", 16), ("mxfp4_w4a16", 4096), ("nvfp4_w4a16", other["tokens"])])
    assert merge_tuned.main(["--into", str(into)]) == 2
    assert "nothing to do" in capsys.readouterr().err
