"""Tuned tile tables and backend plugins: data is parsed as JSON and validated, never executed; a
corrupt table is reported (a warning naming the file and the reason) and ignored, a broken
plugin is reported and skipped. Selection and launches keep working either way."""

from __future__ import annotations

import ast
import json
import logging
from pathlib import Path

import pytest

pytest.importorskip("triton")

from fusedmoe.backends import REGISTRY, Backend, load_plugins, unregister_backend  # noqa: E402
from fusedmoe.backends.triton import tuning  # noqa: E402

SRC = Path(tuning.__file__).parents[2]


def _entry(**kw):
    e = {"dtype": "bfloat16", "experts": 8, "hidden": 64, "inter": 64, "top_k": 2, "gated": True,
         "tokens": 16, "gemm1": [16, 64, 64, 4, 3], "gemm2": [16, 64, 64, 4, 3]}
    e.update(kw)
    return e


def _table_text(*entries, **top):
    data = {"format": 2, "triton": tuning._triton_version(), "entries": list(entries), **top}
    return json.dumps(data)


CORRUPT_FILES = {
    # whole file ignored
    "not_json": ("{not json", "ignoring tuned table"),
    "empty": ("", "ignoring tuned table"),
    "deep_nesting": ("[" * 100_000 + "]" * 100_000, "maximum recursion depth"),
    "not_utf8": (b"\xff\xfe\x00garbage", "ignoring tuned table"),
    "top_level_list": ("[1, 2, 3]", "ignoring tuned table"),
    "entries_not_list": (_table_text().replace("[]", '{"a": 1}'), "'entries' must be a list"),
    "no_format": (json.dumps({"triton": tuning._triton_version(), "entries": []}), "not a fusedmoe tuned table"),
    # one entry ignored, with the reason
    "tokens_inf": (_table_text(_entry(tokens=1)).replace('"tokens": 1', '"tokens": 1e400'),
                   "inf is not an integer"),
    "tokens_float": (_table_text(_entry(tokens=1.5)), "1.5 is not an integer"),
    "gated_string": (_table_text(_entry(gated="yes")), "gated='yes' is not true/false"),
    "dtype_attribute": (_table_text(_entry(dtype="_dynamo")), "unknown dtype '_dynamo'"),
    "dtype_not_string": (_table_text(_entry(dtype=["float16"])), "unknown dtype"),
    "entry_not_object": (_table_text("gemm1"), "malformed"),
    "tile_wrong_arity": (_table_text(_entry(gemm1=[16, 64])), "malformed"),
    "tile_invalid": (_table_text(_entry(gemm1=[16, 24, 64, 4, 3])), "power of two"),
}


@pytest.mark.parametrize("name", CORRUPT_FILES)
def test_corrupt_tuned_table_is_reported_and_ignored(name, tmp_path, caplog):
    text, reason = CORRUPT_FILES[name]
    path = tmp_path / f"{name}.json"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with caplog.at_level(logging.WARNING, logger="fusedmoe"):
        assert tuning._load(str(path), path.stat().st_mtime) == {}
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1 and str(path) in messages[0] and reason in messages[0], messages


def test_valid_entries_survive_an_invalid_neighbour(tmp_path, caplog):
    path = tmp_path / "t.json"
    path.write_text(_table_text(_entry(), _entry(tokens=1e9 + 0.5), _entry(tokens=64)))
    with caplog.at_level(logging.WARNING, logger="fusedmoe"):
        table = tuning._load(str(path), 1.0)
    assert [e.tokens for e in next(iter(table.values()))] == [16, 64]
    assert "entry 1" in caplog.text


def test_packaged_tables_parse_strictly():
    for path in tuning.PACKAGED.glob("*.json"):
        assert tuning.parse_table(json.loads(path.read_text()), str(path), strict=True)


def test_loaders_never_execute_data():
    # Tables, presets and plugins read JSON or import declared entry points: no pickle, eval,
    # exec, torch.load or yaml anywhere in the package.
    banned_calls = {"eval", "exec", "compile", "__import__"}
    banned_attrs = {("pickle", "load"), ("pickle", "loads"), ("torch", "load"), ("yaml", "load"),
                    ("marshal", "loads")}
    for path in (SRC / "fusedmoe").rglob("*.py"):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom):
                names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
                assert not {"pickle", "marshal", "yaml", "dill"} & set(names), f"{path}: {names}"
            if isinstance(node, ast.Call):
                f = node.func
                if isinstance(f, ast.Name):
                    assert f.id not in banned_calls, f"{path}:{node.lineno}: {f.id}()"
                if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name):
                    assert (f.value.id, f.attr) not in banned_attrs, f"{path}:{node.lineno}"


# Plugins ------------------------------------------------------------------------------------------
class _EntryPoint:
    def __init__(self, name, obj):
        self.name, self.obj = name, obj

    def load(self):
        if isinstance(self.obj, Exception):
            raise self.obj
        return self.obj


def _record(name):
    return Backend(name, "test plugin", kinds=frozenset(("oot",)), schemes=frozenset(("unquantized",)),
                   impl="fusedmoe.backends.torch_ref:TorchExperts")


def _raise():
    raise RuntimeError("plugin factory failed")


@pytest.mark.parametrize("obj,reason", [
    ({"name": "not a record"}, "expected a fusedmoe Backend or a list of them, got dict"),
    ("fusedmoe.backends.cpu:CpuExperts", "expected a fusedmoe Backend or a list of them, got str"),
    (lambda: [_record("vendor_ok"), "oops"], "expected a fusedmoe Backend, got str"),  # none registered
    (_raise, "plugin factory failed"),
    (ImportError("no module named 'vendor_moe'"), "no module named 'vendor_moe'"),
    (lambda: [_record("cpu")], "backend 'cpu' is already registered"),
])
def test_broken_plugins_are_reported_and_skipped(obj, reason, caplog):
    cpu = REGISTRY["cpu"]
    with caplog.at_level(logging.WARNING, logger="fusedmoe"):
        added = load_plugins([_EntryPoint("vendor", obj)])
    assert added == []
    assert f"backend plugin 'vendor' failed to load: {reason}" in caplog.text
    assert REGISTRY["cpu"] is cpu  # built-ins untouched
    assert "vendor_ok" not in REGISTRY


def test_a_good_plugin_loads_beside_a_broken_one(caplog):
    with caplog.at_level(logging.WARNING, logger="fusedmoe"):
        added = load_plugins([_EntryPoint("bad", 42), _EntryPoint("good", _record("vendor_npu"))])
    try:
        assert added == ["vendor_npu"] and REGISTRY["vendor_npu"].plugin
        assert "a list of them, got int" in caplog.text
    finally:
        unregister_backend("vendor_npu")
