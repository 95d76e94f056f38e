"""benchmarks/kernel_report.py: the kernels a preset's call would launch, compiled for sm90 on
the CPU (ptxas from Triton's wheel), with their registers, shared memory and SASS mix."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


def _report(tmp_path, *args) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(ROOT / "src"), env.get("PYTHONPATH"))))
    out = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kernel_report.py"), *args, "--json", str(out)],
                          env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode == 2 and "cannot compile for sm90 here" in proc.stderr:
        pytest.skip(proc.stderr.strip())
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())["rows"]


def test_report_of_the_direct_and_aligned_weight_only_kernels(tmp_path):
    rows = _report(tmp_path, "--presets", "qwen3-30b-a3b", "--tokens", "1,256", "--quant", "int4_w4a16_g32",
                   "--ttgir", str(tmp_path / "ttgir"))
    kernels = [(r["tokens"], r["path"], r["kernel"]) for r in rows]
    # --ttgir: each kernel's TTGIR, its source locations and value names dropped (trees compared by diff)
    for tokens, _, kernel in kernels:
        text = (tmp_path / "ttgir" / f"qwen3-30b-a3b_M{tokens}_{kernel}.ttgir").read_text()
        assert f"tt.func public @{kernel}" in text and "loc(" not in text and "%v" in text
        assert re.search(r"%(?!v\b)\w", text) is None, kernel
    assert kernels == [(1, "direct", "moe_gemm1_kernel"), (1, "direct", "moe_gemm2_direct_kernel"),
                       (256, "aligned", "moe_gemm1_kernel"), (256, "aligned", "moe_gemm2_kernel")]
    for r in rows:
        assert r["QUANT"] == 5 and r["regs"] > 0 and r["shared"] > 0 and r["instructions"] > 100, r
        assert r["opcodes"]["HMMA"] + r["opcodes"]["HGMMA"] > 0, r  # tensor-core MMAs
        assert r["opcodes"]["PRMT"] + r["opcodes"]["LOP3"] > 0, r  # the 4-bit decode
        assert 1 <= r["programs_per_sm"] <= 32
        # the K loop: a part of the kernel, holding its MMAs and the decode
        assert 20 < r["loop"]["instructions"] < r["instructions"], r
        assert r["loop"]["opcodes"].get("HGMMA", 0) + r["loop"]["opcodes"].get("HMMA", 0) > 0, r
    assert rows[0]["DIRECT"] is True and rows[0]["BLOCK_M"] == 16
    assert all(r["asm_pack"] == [] for r in rows), rows  # the decodes' packed bytes: consecutive codes
    report = tmp_path / "report.json"  # --diff of a report with itself: every cell, unchanged
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kernel_report.py"), "--diff", str(report),
                           str(report)], env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()[2:]
    assert all(f"{r['regs']:>4} -> {r['regs']:<3}" in line for r, line in zip(rows, lines, strict=True))


def test_fragment_gemms_wait_for_each_wgmma(tmp_path, monkeypatch):
    """The 4-bit fragment GEMMs' dots (the decoded weight tile as the register operand) compile
    with every warpgroup MMA waited for where it is issued (kernels._rs_sync): no wait leaves an
    MMA in flight across the next K step's decode, the read-after-write hazard that computed wrong
    rows on an H200 under Triton 3.6 (triton-lang/triton#9433). FUSEDMOE_TRITON_RS_SYNC=0 gives
    Triton's in-flight form, which the check tells apart. The 128-row plan of the packaged
    Mixtral M=256 entries, on Qwen3-30B's shape (mxfp4: fragments by default)."""
    args = ("--presets", "qwen3-30b-a3b", "--tokens", "256", "--quant", "mxfp4_w4a16",
            "--tiles", "128,128,128,8,3/128,128,64,4,4")
    rows = _report(tmp_path, *args)
    assert [r["kernel"] for r in rows] == ["moe_gemm1_kernel", "moe_gemm2_kernel"]
    for r in rows:
        assert r["RS_SYNC"] is True and r["wgmma_dots"] >= 1, r["kernel"]
        assert r["wgmma_waits"] and set(r["wgmma_waits"]) == {0}, (r["kernel"], r["wgmma_waits"])
        assert r["asm_pack"] == [], r["asm_pack"]  # the decode's packed bytes: 4 consecutive codes a call
    monkeypatch.setenv("FUSEDMOE_TRITON_RS_SYNC", "0")
    rows = _report(tmp_path, *args)
    assert all(r["RS_SYNC"] is False and max(r["wgmma_waits"]) > 0 for r in rows), \
        [(r["kernel"], r["wgmma_waits"]) for r in rows]


def test_tiles_as_a_tuned_table_lists_them(tmp_path):
    """--tiles takes a tuned entry's lists as written (TileConfig.as_list: swap_ab, group_m,
    persistent, one_dot after the integers), and a row names one_dot and the program order's
    group_m: the plan the sixty-seventh session's int4 entries run at Qwen3-30B M=16."""
    rows = _report(tmp_path, "--presets", "qwen3-30b-a3b", "--tokens", "16", "--quant", "int4_w4a16_g32",
                   "--tiles", "16,64,128,4,4,1,null,1,false,true/16,128,64,4,4")
    assert [(r["kernel"], r.get("ONE_DOT", False), r.get("GROUP_M")) for r in rows] == \
        [("moe_gemm1_kernel", True, 1), ("moe_gemm2_kernel", False, 8)]
    assert (rows[1]["BLOCK_N"], rows[1]["BLOCK_K"]) == (128, 64)


@pytest.mark.parametrize("tiles,match", [("16,64,abc,4,4/16,64,64,4,4", "Expecting value"),
                                         ("16,64,128,4,4,1,null,8,false,1/16,64,64,4,4", "one_dot=1 is not true/false"),
                                         ("16,64,128,4,4", "1 tiles given, want GEMM1/GEMM2")])
def test_bad_tiles_are_a_usage_error(tiles, match):
    """A --tiles that does not parse is refused before anything compiles, naming the value."""
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kernel_report.py"), "--presets", "qwen3-30b-a3b",
                           "--tokens", "16", "--tiles", tiles], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert proc.returncode == 2 and f"--tiles {tiles!r}: " in proc.stderr and match in proc.stderr, proc.stderr[-800:]


@pytest.mark.parametrize("scheme", ["mxfp4_w4a16", "int4_w4a16_g64"])
def test_no_register_operand_wgmma_is_left_in_flight(tmp_path, monkeypatch, scheme):
    """Every kernel of a 4-bit call in the fragment layout (int4 g64 by FUSEDMOE_TRITON_W4_FRAGMENTS=all),
    the direct decode (M=1) and the aligned prefill (M=4096) on the plans the library picks:
    where a warpgroup MMA takes a register operand, every wait is for all MMAs (`wgmma_waits` 0)."""
    monkeypatch.setenv("FUSEDMOE_TRITON_W4_FRAGMENTS", "all")
    rows = _report(tmp_path, "--presets", "gpt-oss-120b", "--tokens", "1,4096", "--quant", scheme)
    assert {r["path"] for r in rows} == {"direct", "aligned"}, [(r["path"], r["kernel"]) for r in rows]
    rs = [r for r in rows if r["wgmma_rs"]]
    assert any(r["path"] == "aligned" for r in rs), [(r["kernel"], r["wgmma_rs"]) for r in rows]
    assert all(set(r["wgmma_waits"]) == {0} for r in rs), [(r["kernel"], r["wgmma_waits"]) for r in rs]


@pytest.mark.parametrize("scheme", ["fp8_w8a8_block", "int8_w8a8"])
def test_report_of_w8a8_at_large_m_uses_wgmma_and_descriptors(tmp_path, scheme):
    """Qwen3-30B M=4096: both GEMMs on warpgroup MMAs (fp8 ones for fp8 codes), the weights (and
    GEMM2's sorted code rows) through TMA descriptors (bulk tensor loads in the SASS)."""
    rows = _report(tmp_path, "--presets", "qwen3-30b-a3b", "--tokens", "4096", "--quant", scheme)
    assert [r["kernel"] for r in rows] == ["moe_gemm1_kernel", "moe_gemm2_kernel"]
    assert all(r["opcodes"]["WARPGROUP"] > 0 and r["BLOCK_M"] >= 64 for r in rows), rows
    if scheme == "fp8_w8a8_block":
        assert all(r["opcodes"]["QGMMA"] > 0 for r in rows), rows
    assert [(r["W_DESC"], r.get("A_DESC")) for r in rows] == [(True, None), (True, True)], rows
    assert all(r["opcodes"]["UTMALDG"] > 0 for r in rows), rows


def test_unquantized_kernels_do_not_spill(tmp_path):
    """A guard for Triton upgrades (Triton is not pinned): every bf16 kernel the five presets'
    decode and prefill calls launch compiles for sm90 without spilling registers to local memory,
    on the heuristic's tiles: the tuned tables' tiles run only under the Triton they were tuned
    with, which the report now plans as (under Triton 3.9 the H200 table's persistent gpt-oss
    M=4096 GEMM1 spills 8 bytes; under 3.6, which runs it, it compiled to 255 registers)."""
    rows = _report(tmp_path, "--presets", "mixtral-8x7b,qwen3-30b-a3b,deepseek-v3,gpt-oss-120b,llama-4-maverick",
                   "--tokens", "1,4096", "--device-name", "none")
    assert len(rows) == 20, [(r["preset"], r["tokens"], r["kernel"]) for r in rows]
    spills = [(r["preset"], r["tokens"], r["kernel"], r["stack"]) for r in rows if r["stack"] > 0]
    assert not spills, f"kernels spill registers (bytes of stack per thread): {spills}"


@pytest.mark.parametrize("scheme", ["int8_w8a8", "fp8_w8a8_block"])
def test_row_stationary_gemm2_with_a_tail_tile_compiles(tmp_path, scheme):
    """Qwen3-235B TP4 (I = 384) at M=4096: the aligned W8A8 GEMM2 is the row-stationary kernel with a
    256-wide head tile (and a 128-wide tail), and it compiles for sm90 without spills. The
    interpreter runs code a GPU compile may refuse (Triton 3.6 refused an int32 accumulator passed
    to tl.dot without its out_dtype; 3.9 takes it), so the tail form is compiled here too."""
    rows = _report(tmp_path, "--presets", "qwen3-235b-a22b", "--tokens", "4096", "--quant", scheme)
    gemm2 = [r for r in rows if r["kernel"] == "moe_gemm2_rows_kernel"]
    assert len(gemm2) == 1 and gemm2[0]["BLOCK_I"] == 256, rows
    assert gemm2[0]["stack"] == 0, gemm2


def test_loop_mix_finds_the_longest_backward_branch():
    """kernel_report.loop_mix: the longest span from a backward branch's target to the branch,
    its opcodes counted; a listing without one gives 0."""
    from fusedmoe.backends.triton.kernel_report import loop_mix

    sass = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   IADD3 R2, R2, 0x1, RZ ;
        /*0020*/                   LOP3.LUT R3, R2, 0xf, RZ, 0xc0, !PT ;
        /*0030*/                   HGMMA.64x16x16.F32.BF16 R32, R4, gdesc[UR16], R32, gsb0 ;
        /*0040*/               @!P0 BRA 0x10 ;
        /*0050*/                   LOP3.LUT R5, R5, 0xf, RZ, 0xc0, !PT ;
        /*0060*/                   @P1 BRA 0x50 ;
        /*0070*/                   EXIT ;
    """
    assert loop_mix(sass) == {"instructions": 4, "opcodes": {"IADD3": 1, "LOP3": 1, "HGMMA": 1, "BRA": 1}}
    assert loop_mix(sass.replace("BRA 0x10", "BRA 0x70").replace("BRA 0x50", "BRA 0x70")) == {
        "instructions": 0, "opcodes": {}}


def test_loop_hazards_name_spills_and_serialized_wgmma():
    """kernel_report.loop_hazards: local loads / stores in the K loop, and WARPGROUP arrive / wait
    twice per MMA or more (each wgmma waited on alone); a pipelined loop has none."""
    from fusedmoe.backends.triton.kernel_report import loop_hazards

    assert loop_hazards({"instructions": 425, "opcodes": {"LOP3": 97, "HGMMA": 16, "WARPGROUP": 9}}) == []
    assert loop_hazards({"instructions": 0, "opcodes": {}}) == []
    assert loop_hazards({"opcodes": {"HGMMA": 32, "WARPGROUP": 64, "LDL": 11}}) == [
        "spills in the loop (LDL 11)", "wgmma serialized (64 WARPGROUP for 32 MMA)"]
    assert loop_hazards({"opcodes": {"QGMMA": 4, "WARPGROUP": 9, "STL": 2}}) == ["spills in the loop (STL 2)"]
    assert loop_hazards({"opcodes": {"QGMMA": 8, "WARPGROUP": 16}}) == ["wgmma serialized (16 WARPGROUP for 8 MMA)"]


def test_plans_come_from_the_named_gpus_table_whatever_triton_compiles(tmp_path, monkeypatch):
    """--device-name's tuned table decides the plan as it would on that GPU, which runs the Triton
    the table was tuned with: tables load only under their own Triton (major.minor), and this
    machine's may be another (the report compiled heuristic plans while saying otherwise)."""
    table = {"format": 3, "device": "NVIDIA H200", "triton": "3.6.0", "entries": [
        {"dtype": "bfloat16", "experts": 128, "hidden": 2048, "inter": 768, "top_k": 8, "gated": True,
         "tokens": 256, "quant": "int4_w4a16_g32", "layout": "fragments", "gemm1": [16, 64, 128, 4, 2, 1],
         "gemm2": [16, 64, 128, 4, 2, 1]}]}
    (tmp_path / "NVIDIA_H200.json").write_text(json.dumps(table))
    monkeypatch.setenv("FUSEDMOE_TUNED_DIR", str(tmp_path))
    rows = _report(tmp_path, "--presets", "qwen3-30b-a3b", "--tokens", "256", "--quant", "int4_w4a16_g32",
                   "--device-name", "NVIDIA H200")
    assert [(r["path"], r["kernel"]) for r in rows] == [("aligned", "moe_gemm1_kernel"), ("aligned", "moe_gemm2_kernel")]
    for r in rows:
        assert (r["BLOCK_M"], r["BLOCK_N"], r["BLOCK_K"], r["num_stages"]) == (16, 64, 128, 2), r


def test_asm_pack_hazards_flag_a_decode_whose_packed_registers_are_not_consecutive():
    """kernel_report.asm_pack_hazards: a cross-element inline asm (the 4-bit fragment decodes, a word
    of 4 code bytes) packing 4 elements a call on a layout whose first registers hold elements 0,
    1, 4, 5 (the TTGIR of the fragment decode that computed wrong int4 g64 results on an H200) or
    one element a thread is flagged; registers 0-3 holding elements 0-3 are not; an asm whose
    elements are independent (not among the bodies) never is. The bodies checked by default are
    the fragment decodes' PTX."""
    from fusedmoe.backends.triton import kernels
    from fusedmoe.backends.triton.kernel_report import asm_pack_hazards, cross_element_asm

    body = "lop3.b32 $0, $4;"

    def ttgir(register, blocked="[1, 1, 4]"):
        return ("#blocked = #ttg.blocked<{sizePerThread = " + blocked + ", threadsPerWarp = [8, 2, 2], "
                "warpsPerCTA = [1, 4, 1], order = [2, 0, 1]}>\n"
                "#linear1 = #ttg.linear<{register = " + register + ", lane = [[0, 2], [1, 0], [2, 0], [4, 0], "
                "[0, 64]], warp = [[0, 128], [0, 256]], block = []}>\n"
                '    %w:2 = tt.elementwise_inline_asm "' + body.replace("\n", "\\0A") + '" {constraints = '
                '"=r,=r,=r,=r,r,r,r", packed_element = 4 : i32, pure = true} %b, %s : tensor<8x512xi8, #linear1>, '
                "tensor<8x8x4xbf16, #blocked> -> tensor<8x512xbf16, #linear1>\n")

    good, bad = "[[0, 1], [0, 2], [0, 4], [0, 8], [4, 0]]", "[[0, 1], [0, 4], [0, 8], [0, 16], [0, 32]]"
    assert asm_pack_hazards(ttgir(good), (body,)) == []
    found = asm_pack_hazards(ttgir(bad), (body,))
    assert len(found) == 1 and "#linear1" in found[0] and "not 4 consecutive" in found[0]
    assert len(asm_pack_hazards(ttgir(good, blocked="[1, 1, 1]"), (body,))) == 1  # one element a thread
    assert asm_pack_hazards(ttgir(bad), ("another body",)) == []  # elements independent: not checked
    assert kernels.W4_PTX_I4FRAG.value in cross_element_asm() and len(cross_element_asm()) == 3
    body = kernels.W4_PTX_I4FRAG.value  # the real decode, newlines escaped as the TTGIR prints them
    assert len(asm_pack_hazards(ttgir(bad))) == 1 and asm_pack_hazards(ttgir(good)) == []


def test_programs_per_sm_count_the_allocation_units():
    """kernel_report.programs_per_sm: registers rounded up to 8 a thread (84 holds as many
    programs as 88: 5 of 128 threads), shared memory with its 1 KiB reserve out of 228 KiB (a
    program of 113 KiB fits twice: 2 x 114 = 228), at most 32."""
    from fusedmoe.backends.triton.kernel_report import programs_per_sm

    assert programs_per_sm(84, 128, 24576) == programs_per_sm(88, 128, 24576) == 5
    assert programs_per_sm(80, 128, 24576) == 6
    assert programs_per_sm(32, 128, 113 * 1024) == 2 and programs_per_sm(32, 128, 113 * 1024 + 1) == 1
    assert programs_per_sm(16, 32, 0) == 32


@pytest.mark.parametrize(("quant", "presets", "tokens"), [
    ("int4_w4a16_g128_zp", "gpt-oss-120b,mixtral-8x7b", "16"),  # gpt-oss: H = 2880, skipped as bench does
    ("mxfp4_w4a16", "gpt-oss-120b", "16"),
    ("nvfp4_w4a16", "mixtral-8x7b", "1"),
])
def test_fragment_decodes_pack_consecutive_codes(tmp_path, quant, presets, tokens):
    """Every 4-bit fragment format's GEMMs, their scales (and zero points) loaded once a row group
    as 32-bit words (kernels._w4_group_values): no decode's packed registers hold other than 4
    consecutive codes. The form that computed wrong on an H200 (the values loaded as they are:
    int4 g128 / g128_zp's bf16 pair and mxfp4's byte quad went to registers, not through shared
    memory) is flagged in the int4 and mxfp4 cells, under Triton 3.6 and 3.9."""
    rows = _report(tmp_path, "--presets", presets, "--tokens", tokens, "--quant", quant)
    assert rows and {r["preset"] for r in rows} == {presets.split(",")[-1]}, rows
    assert all(r["asm_pack"] == [] for r in rows), [r["asm_pack"] for r in rows]
