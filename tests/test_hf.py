"""transformers integration: patched and hooked models against the models' own outputs.

Each family: a small random model (MoE tensors redrawn so that they move the logits), prefill
logits and greedy decode (ids and per-step logits) within 1e-5 relative error of transformers,
unpatch restores the model bit for bit, and the checkpoint format survives patching. On a GPU
(bf16): blocks and whole-model `generate` at realistic sizes, each at least as close to float32 as
transformers' own bf16; FP8 experts against transformers' own FP8 forward. Without a GPU: the
logic of benchmarks/hf_bench.py.
"""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch

from fusedmoe import knobs

if knobs.get("REQUIRE_HF"):  # scripts/test.sh (CI): a missing or broken transformers fails loudly
    import transformers
else:
    transformers = pytest.importorskip("transformers")

import fusedmoe.hf as fh  # noqa: E402
from fusedmoe.hf import families as fam_table  # noqa: E402
from fusedmoe.hf.models import build, tiny_config  # noqa: E402
from fusedmoe.reference import fused_experts_ref  # noqa: E402

RTOL = 1e-5  # fp32: ours and transformers' differ by summation order only (~3e-7 seen)
# Families whose MoE blocks no causal-LM class runs from token ids: tested on their text model
# (test_text_model_only_families)
TEXT_MODEL_ONLY = {"qwen3_omni_moe_talker_text": "Qwen3OmniMoeTalkerModel"}
SUPPORTED = [f.model_type for f in fh.FAMILIES if not f.refused and f.model_type not in TEXT_MODEL_ONLY]
# Families whose experts class is @use_experts_implementation with fusedmoe's layout (with a
# refused block whose experts the hook runs: ZAYA).
HOOKED = [f.model_type for f in fh.FAMILIES
          if f.config and f.layout in ("fused", "up_only") and f.model_type not in TEXT_MODEL_ONLY]
NEW_TOKENS = 4


def _min_transformers() -> str:
    """The hf extra's minimum transformers version, from pyproject.toml (read as text: Python 3.10
    has no tomllib)."""
    import re
    from pathlib import Path

    text = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    return re.search(r'^hf = \[.*"transformers>=([\d.]+)"', text, re.MULTILINE).group(1)


def _below_minimum() -> bool:
    """The installed transformers is older than the hf extra's minimum (the GPU machine's)."""
    from packaging.version import Version

    return Version(transformers.__version__) < Version(_min_transformers())


def _unrunnable(model_type: str) -> str | None:
    """Why the installed transformers cannot run this family's tests, or None. A family newer than
    it has no model; below the hf extra's minimum (the GPU machine's transformers may be older than
    CI's) a family's config may refuse the tiny config written for the newer one (its layer-type
    names changed between releases)."""
    from importlib.util import find_spec

    try:
        if find_spec(fh.family(model_type).module_path) is None:
            raise ModuleNotFoundError
    except ModuleNotFoundError:
        return f"transformers {transformers.__version__} has no {model_type} model"
    if _below_minimum():
        try:
            tiny_config(model_type)
        except Exception as err:  # noqa: BLE001 - any refusal of the config by that release
            return (f"transformers {transformers.__version__} (the hf extra needs >= {_min_transformers()}) "
                    f"refuses {model_type}'s tiny config: {str(err).splitlines()[-1][:160]}")
    return None


def _on_a_supported_transformers(model_type: str, run):
    """run(), except that below the hf extra's minimum transformers (the GPU machine's may be
    older) a family whose block that release builds differently (patch raises UnsupportedModel)
    skips, naming why; from the minimum on the error fails the test."""
    try:
        return run()
    except fh.UnsupportedModel as err:
        if not _below_minimum():
            raise
        pytest.skip(f"transformers {transformers.__version__} (the hf extra needs >= {_min_transformers()}) "
                    f"builds {model_type}'s block differently: {err}")


def installed(model_types: list[str]) -> list:
    """The model types as parameters, each skipped where the installed transformers cannot run
    it (`_unrunnable` says why)."""
    params = []
    for t in model_types:
        why = _unrunnable(t)
        params.append(pytest.param(t, marks=pytest.mark.skipif(why is not None, reason=why or "")))
    return params


def test_min_transformers_is_the_hf_extras():
    assert _min_transformers() == "5.23"


@pytest.fixture
def hook_calls(monkeypatch) -> list:
    """Counts calls of the experts hook's fused_experts path (proves the hook really ran)."""
    import fusedmoe.hf.experts as hf_experts

    calls, real = [], hf_experts.run_experts

    def counting(*args, **kwargs):
        calls.append(type(args[0]).__name__)
        return real(*args, **kwargs)

    monkeypatch.setattr(hf_experts, "run_experts", counting)
    return calls


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def prompt(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(seed))


def run(model, ids):
    """(prefill logits, generated ids, per-step decode logits) with greedy decoding."""
    with torch.no_grad():
        logits = model(ids).logits
        gen = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False,
            output_logits=True, return_dict_in_generate=True, pad_token_id=0,
        )
    return logits, gen.sequences, torch.stack(gen.logits)


def assert_same_outputs(got, want):
    (logits, seq, steps), (ref_logits, ref_seq, ref_steps) = got, want
    assert rel_err(logits, ref_logits) < RTOL
    assert torch.equal(seq, ref_seq)
    for step in range(NEW_TOKENS):
        assert rel_err(steps[step], ref_steps[step]) < RTOL, f"decode step {step}"


@pytest.mark.parametrize("model_type", installed(SUPPORTED))
def test_patch_matches_transformers_and_unpatch_restores(model_type):
    model = build(model_type)
    ids = prompt()
    ref = run(model, ids)
    state = {k: v.clone() for k, v in model.state_dict().items()}

    patched = fh.patch(model)
    assert patched and all(name == fh.family(model_type).name for _, name in patched)
    assert fh.is_patched(model)
    assert_same_outputs(run(model, ids), ref)
    # Checkpoint format unchanged while patched: same keys, order, shapes and values.
    now = model.state_dict()
    assert list(now) == list(state)
    assert all(torch.equal(now[k], state[k]) for k in state)

    assert fh.unpatch(model) == len(patched)
    assert not fh.is_patched(model)
    after = model.state_dict()
    assert list(after) == list(state) and all(torch.equal(after[k], state[k]) for k in state)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref[0])


@pytest.mark.parametrize("model_type", installed(SUPPORTED))
def test_routing_and_experts_matter(model_type):
    """The comparison above has teeth: the logits move when the experts of one block change."""
    model = build(model_type)
    ids = prompt()
    fh.patch(model)
    with torch.no_grad():
        good = model(ids).logits
        block = next(m for m in model.modules() if fh.is_patched(m) and hasattr(m, "_fusedmoe_patch"))
        w13 = block._fusedmoe_patch.layout.tensors(block._fusedmoe_patch.family.experts_of(block))[0]
        w13.mul_(-1)  # in fusedmoe's layout: flips gates (and relu2's input)
        assert rel_err(model(ids).logits, good) > 1e-3


@pytest.mark.parametrize("model_type", installed(SUPPORTED))
def test_output_router_logits(model_type):
    """output_router_logits=True: the same per-layer router logits (and aux loss) as transformers."""
    model = build(model_type)
    ids = prompt()
    with torch.no_grad():
        want = model(ids, output_router_logits=True)
        fh.patch(model)
        got = model(ids, output_router_logits=True)
    if want.router_logits is None:
        assert got.router_logits is None
        return
    assert len(got.router_logits) == len(want.router_logits) > 0
    for g, w in zip(got.router_logits, want.router_logits, strict=True):
        assert rel_err(g, w) < RTOL
    if getattr(want, "aux_loss", None) is not None:  # Inkling's output has no aux_loss
        assert rel_err(got.aux_loss, want.aux_loss) < RTOL


@pytest.mark.parametrize("model_type", ["gpt_oss", "llama4_text", "dbrx", "aria_text", "qwen2_moe"])
def test_patched_model_loads_transformers_checkpoints(model_type):
    """load_state_dict of a checkpoint in transformers' layout into a patched (re-laid-out) model."""
    source = build(model_type, seed=1)
    ids = prompt()
    with torch.no_grad():
        want = source(ids).logits
    target = build(model_type, seed=2)
    fh.patch(target)
    target.load_state_dict(source.state_dict())
    with torch.no_grad():
        assert rel_err(target(ids).logits, want) < RTOL


@pytest.mark.parametrize("model_type", installed(HOOKED))
def test_experts_implementation_fusedmoe(model_type, hook_calls):
    ids = prompt()
    model = build(model_type)
    ref = run(model, ids)
    assert not hook_calls
    model.set_experts_implementation("fusedmoe")
    assert model.config._experts_implementation == "fusedmoe"
    assert_same_outputs(run(model, ids), ref)
    assert hook_calls


def test_from_config_with_experts_implementation(hook_calls):
    config = tiny_config("qwen3_moe")
    model = transformers.AutoModelForCausalLM.from_config(config, experts_implementation="fusedmoe")
    assert model.config._experts_implementation == "fusedmoe"
    ids = prompt()
    with torch.no_grad():
        got = model(ids).logits
        assert len(hook_calls) == config.num_hidden_layers
        model.set_experts_implementation("eager")
        assert rel_err(got, model(ids).logits) < RTOL


def test_from_pretrained_with_experts_implementation(tmp_path, hook_calls):
    model = build("deepseek_v3")
    ids = prompt()
    with torch.no_grad():
        want = model(ids).logits
    model.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, experts_implementation="fusedmoe")
    assert loaded.config._experts_implementation == "fusedmoe"
    with torch.no_grad():
        assert rel_err(loaded.eval()(ids).logits, want) < RTOL
    assert hook_calls == ["DeepseekV3Experts"]  # first_k_dense_replace=1: one MoE layer of two


def test_experts_hook_refuses_transposed_experts():
    model = build("gpt_oss")
    model.set_experts_implementation("fusedmoe")
    with pytest.raises(fh.UnsupportedModel, match=r"GptOssExperts .*fusedmoe\.hf\.patch"), torch.no_grad():
        model(prompt())


def test_experts_hook_expert_parallel_placeholders():
    """Ids >= E with weight 0 (transformers' EP placeholders) add nothing."""
    model = build("mixtral")
    experts = model.model.layers[0].mlp.experts
    x = torch.randn(5, 64)
    ids = torch.tensor([[0, 1], [2, 3], [1, 2], [3, 0], [0, 2]])
    weights = torch.rand(5, 2)
    want = fh.experts_forward(experts, x, ids, weights)
    experts._is_expert_parallel = True
    ids_ep = torch.cat((ids, torch.full((5, 1), 4), torch.full((5, 1), 7)), dim=1)
    weights_ep = torch.cat((weights, torch.zeros(5, 2)), dim=1)
    got = fh.experts_forward(experts, x, ids_ep, weights_ep)
    assert rel_err(got, want) < RTOL


@pytest.mark.parametrize("model_type", ["qwen2_moe", "dbrx"])  # dbrx: re-laid-out experts, p-norm routing
def test_compile_patched_model(model_type):
    model = build(model_type)
    ids = prompt()
    with torch.no_grad():
        want = model(ids).logits
        fh.patch(model)
        compiled = torch.compile(model, fullgraph=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = compiled(ids).logits
        assert rel_err(got, want) < RTOL
    # the patched forward traces without Dynamo's warnings about it (a functools.cache'd lookup
    # in the router-logits recording warned once per compiled model)
    ours = [str(w.message) for w in caught if "patch.py" in str(w.message) or "fusedmoe" in str(w.message)]
    assert not ours, ours


@pytest.mark.parametrize("model_type", ["qwen3_moe", "ernie4_5_vl_moe_text"])  # hook on the router / the modality block
def test_output_router_logits_compiled(model_type):
    """output_router_logits=True under torch.compile(fullgraph=True): a patched block hands its
    router logits to transformers' collector inside the traced region too."""
    model = build(model_type)
    ids = prompt()
    with torch.no_grad():
        want = model(ids, output_router_logits=True)
        fh.patch(model)
        got = torch.compile(model, fullgraph=True)(ids, output_router_logits=True)
    assert rel_err(got.logits, want.logits) < RTOL
    assert len(got.router_logits) == len(want.router_logits) > 0
    for g, w in zip(got.router_logits, want.router_logits, strict=True):
        assert rel_err(g, w) < RTOL


def _fp8_experts(config, w13: torch.Tensor, w2: torch.Tensor):
    """transformers' FP8Experts (block 128, dynamic) holding w13/w2 quantized; and the dequantized
    weights it really holds."""
    from transformers.integrations.finegrained_fp8 import ALL_FP8_EXPERTS_FUNCTIONS, FP8Experts
    from transformers.integrations.moe import use_experts_implementation

    cls = use_experts_implementation(experts_class=FP8Experts, experts_interface=ALL_FP8_EXPERTS_FUNCTIONS)
    experts = cls(config, block_size=(128, 128))

    def blocks(s):
        return s.repeat_interleave(128, 1).repeat_interleave(128, 2)

    dequant = []
    with torch.no_grad():
        for weight, scale, w in ((experts.gate_up_proj, experts.gate_up_proj_scale_inv, w13),
                                 (experts.down_proj, experts.down_proj_scale_inv, w2)):
            s = w.abs().unflatten(1, (-1, 128)).unflatten(3, (-1, 128)).amax(dim=(2, 4)) / 448
            scale.copy_(s)
            weight.copy_((w / blocks(s)).to(torch.float8_e4m3fn))
            dequant.append(weight.float() * blocks(scale))
    return experts, dequant


def _fp8_config():
    return tiny_config("qwen3_moe", hidden_size=128, moe_intermediate_size=128, head_dim=32)


def test_compile_with_experts_hook(hook_calls):
    model = build("qwen3_moe")
    ids = prompt()
    with torch.no_grad():
        want = model(ids).logits
        model.set_experts_implementation("fusedmoe")
        compiled = torch.compile(model, fullgraph=True)
        assert rel_err(compiled(ids).logits, want) < RTOL
    assert hook_calls  # traced through the hook into fusedmoe::hf_experts


def test_fp8_experts_hook():
    """transformers' block-FP8 experts through the hook: the math on dequantized weights."""
    config = _fp8_config()
    config._experts_implementation = "fusedmoe"
    g = torch.Generator().manual_seed(0)
    e, i, h = 4, 128, 128
    experts, (w13, w2) = _fp8_experts(config, torch.randn(e, 2 * i, h, generator=g) * 0.1,
                                      torch.randn(e, h, i, generator=g) * 0.1)
    x = torch.randn(6, h, generator=g)
    ids = torch.tensor([[0, 1], [2, 3], [1, 2], [3, 0], [0, 2], [1, 3]])
    weights = torch.softmax(torch.randn(6, 2, generator=g), dim=-1)
    got = experts(x, ids, weights)
    want = fused_experts_ref(x, w13, w2, weights, ids)
    assert rel_err(got, want) < 0.05  # fp8 activations: ~2-3% relative error
    assert rel_err(got, want) > 0  # the activations really were quantized


def _fp8_linear_torch(input, weight, weight_scale_inv, block_size=None, bias=None,
                      activation_scale=None):
    """transformers' `finegrained_fp8_linear` (a Triton kernel from the Hub, CUDA only) in torch:
    dynamic activation groups of 128, s_a = amax / 448; y = sum_j (q_a_j s_a_j)(q_w_j s_w_j)^T,
    returned in the input's dtype (the kernel's output dtype)."""
    assert activation_scale is None and bias is None and tuple(block_size) == (128, 128)
    k = weight.shape[1]
    x_g = input.float().unflatten(-1, (k // 128, 128))
    s_a = x_g.abs().amax(-1, keepdim=True) / 448
    x = ((x_g / s_a).to(torch.float8_e4m3fn).float() * s_a).flatten(-2)
    w = weight.float() * weight_scale_inv.repeat_interleave(128, 0).repeat_interleave(128, 1)
    return (x @ w.T).to(input.dtype)


def _fp8_problem(config, device="cpu", dtype=torch.float32, tokens=6, seed=0):
    """transformers' FP8Experts for `config` (random weights, std 0.1), its dequantized weights,
    and routing inputs (distinct experts per token)."""
    g = torch.Generator().manual_seed(seed)
    e, k = config.num_experts, config.num_experts_per_tok
    i, h = config.moe_intermediate_size, config.hidden_size
    experts, (w13, w2) = _fp8_experts(config, torch.randn(e, 2 * i, h, generator=g) * 0.1,
                                      torch.randn(e, h, i, generator=g) * 0.1)
    x = torch.randn(tokens, h, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, k, generator=g), dim=-1)
    return (experts.to(device), w13.to(device), w2.to(device), x.to(device), ids.to(device),
            weights.to(device))


def test_fp8_experts_match_transformers_fp8(monkeypatch):
    """The hook against transformers' own FP8Experts forward (its loop, gate, routing weights,
    activation quantization) with its Hub kernel emulated in torch (`_fp8_linear_torch`): equal
    up to summation order in float32, where both quantize the same activations."""
    import transformers.integrations.finegrained_fp8 as finegrained_fp8

    monkeypatch.setattr(finegrained_fp8, "finegrained_fp8_linear", _fp8_linear_torch)
    config = tiny_config("qwen3_moe", hidden_size=512, moe_intermediate_size=256, num_experts=16,
                         num_experts_per_tok=4, head_dim=32)
    experts, w13, w2, x, ids, weights = _fp8_problem(config, tokens=32)
    config._experts_implementation = "eager"
    theirs = experts(x, ids, weights)
    config._experts_implementation = "fusedmoe"
    ours = experts(x, ids, weights)
    assert rel_err(ours, theirs) < RTOL  # seen: 1.1e-7
    assert rel_err(theirs, fused_experts_ref(x, w13, w2, weights, ids)) > 1e-2  # really fp8


@pytest.mark.gpu
def test_fp8_experts_match_transformers_fp8_gpu():
    """bf16 on the GPU at hidden 1024, 32 experts, top-8: the hook (fusedmoe's fp8_w8a8_block
    kernels) against transformers' own FP8Experts forward with its real kernels (the Hub's
    finegrained-fp8 Triton kernel or DeepGEMM, through the `kernels` package)."""
    from transformers.utils.import_utils import is_kernels_available

    if not is_kernels_available():
        pytest.skip("transformers' FP8 experts run a Hub kernel through the `kernels` package, "
                    "which is not installed")
    config = tiny_config("qwen3_moe", hidden_size=1024, moe_intermediate_size=512, num_experts=32,
                         num_experts_per_tok=8, head_dim=64)
    experts, w13, w2, x, ids, weights = _fp8_problem(config, "cuda", torch.bfloat16, tokens=64)
    config._experts_implementation = "eager"
    try:
        theirs = experts(x, ids, weights)
    except ImportError as exc:  # `kernels` is there but the kernel could not be loaded (offline)
        pytest.skip(f"transformers' FP8 kernel is not available: {exc}")
    config._experts_implementation = "fusedmoe"
    ours = experts(x, ids, weights)
    want = fused_experts_ref(x.float(), w13, w2, weights, ids)
    # CPU, the same problem with the kernel emulated: ours vs theirs 1.6e-2 (transformers rounds
    # the first GEMM's output to bf16 before the gate and the second quantization, fusedmoe keeps
    # float32: fp8 codes of the intermediate differ), both 4.4e-2 from the dequantized weights'
    # math without activation quantization.
    assert rel_err(ours, theirs) < 0.04
    assert rel_err(ours, want) <= 1.25 * rel_err(theirs, want) + 1e-3


def test_fp8_experts_patch():
    """patch() on a model whose experts are FP8Experts runs them quantized, as the hook does."""
    model = build("qwen3_moe", hidden_size=128, moe_intermediate_size=128, head_dim=32)
    for layer in model.model.layers:
        old = layer.mlp.experts
        layer.mlp.experts, _ = _fp8_experts(model.config, old.gate_up_proj.data, old.down_proj.data)
    ids = prompt()
    with torch.no_grad():
        model.set_experts_implementation("fusedmoe")
        hooked = model(ids).logits
        fh.patch(model)
        assert rel_err(model(ids).logits, hooked) < RTOL
        fh.unpatch(model)
        model.set_experts_implementation("eager")  # transformers' own FP8 needs its GPU kernels


def test_fp8_static_activations_are_refused():
    config = _fp8_config()
    config._experts_implementation = "fusedmoe"
    experts, _ = _fp8_experts(config, torch.randn(4, 256, 128), torch.randn(4, 128, 128))
    experts.activation_scheme = "static"
    with pytest.raises(fh.UnsupportedModel, match="activation_scheme='static'"):
        experts(torch.randn(2, 128), torch.zeros(2, 2, dtype=torch.long), torch.ones(2, 2))


def test_save_pretrained_of_a_patched_model(tmp_path):
    """A patched (re-laid-out) model saves transformers' checkpoint format."""
    for model_type in ("gpt_oss", "dbrx"):
        model = build(model_type)
        ids = prompt()
        with torch.no_grad():
            want = model(ids).logits
        fh.patch(model)
        model.save_pretrained(tmp_path / model_type)
        loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / model_type).eval()
        with torch.no_grad():
            assert rel_err(loaded(ids).logits, want) < RTOL


def test_llama4_top2_is_refused_by_name():
    model = build("llama4_text", num_experts_per_tok=2)
    with pytest.raises(fh.UnsupportedModel, match="top_k == 1"):
        fh.patch(model)
    assert not fh.is_patched(model)


def test_refused_family_names_the_feature(monkeypatch):
    refused = next(f for f in fh.FAMILIES if f.refused)
    # A stand-in block of the refused family: patch() identifies blocks by class and module.
    fake = type(refused.block, (torch.nn.Module,), {"__module__": refused.module_path})
    model = torch.nn.Sequential(fake())
    with pytest.raises(fh.UnsupportedModel, match=refused.refused.split(" (")[0][:30]):
        fh.patch(model)


def test_gemma4_patch_is_refused_and_the_experts_hook_matches(hook_calls):
    """Gemma-4's MoE has no block module: patch() names that before changing anything; the experts
    hook (its router and dense MLP left to transformers) matches transformers' logits."""
    config = transformers.Gemma4TextConfig(
        vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, global_head_dim=16, intermediate_size=48, moe_intermediate_size=32, num_experts=8,
        top_k_experts=2, enable_moe_block=True, hidden_size_per_layer_input=0, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"], max_position_embeddings=128)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # router and experts redrawn so that they move the logits
        for layer in model.model.layers:
            for p in (*layer.router.parameters(), *layer.experts.parameters()):
                p.copy_(torch.randn(p.shape) * 0.3)
    with pytest.raises(fh.UnsupportedModel, match="Gemma-4 .*no MoE block module"):
        fh.patch(model)
    assert not fh.is_patched(model)
    ids = prompt()
    ref = run(model, ids)
    model.set_experts_implementation("fusedmoe")
    assert_same_outputs(run(model, ids), ref)
    assert hook_calls


def test_patch_without_moe_blocks():
    with pytest.raises(ValueError, match="no MoE block"):
        fh.patch(torch.nn.Sequential(torch.nn.Linear(4, 4)))


def test_patch_is_idempotent():
    model = build("mixtral")
    first = fh.patch(model)
    assert fh.patch(model) == [] and len(first) == 2
    assert fh.unpatch(model) == 2


def test_cuda_graphs_argument():
    """patch(model, cuda_graphs=...): a bool or a positive token count, checked before any block
    changes; off the GPU the blocks run eagerly (the same outputs, no graph)."""
    model = build("qwen3_moe")
    for bad in (0, -4, 2.5, "yes"):
        with pytest.raises(ValueError, match="cuda_graphs"):
            fh.patch(model, cuda_graphs=bad)
    assert not fh.is_patched(model)
    ids = prompt()
    want = run(model, ids)
    blocks = [m for m in model.modules() if _is_block(m)]
    fh.patch(model, cuda_graphs=8)
    assert_same_outputs(run(model, ids), want)
    assert blocks and all(b._fusedmoe_patch.graphs.max_tokens == 8 and not b._fusedmoe_patch.graphs.graphs
                          for b in blocks)


@pytest.mark.parametrize("model_type", installed(["zaya"]))
def test_refused_block_with_hooked_experts(model_type):
    """ZAYA: patch refuses its block (an MLP router carrying state across layers) before changing
    anything; its experts run through the hook (test_experts_implementation_fusedmoe)."""
    model = build(model_type)
    with pytest.raises(fh.UnsupportedModel, match=r"ZAYA \(model\.layers\.0\.mlp: ZayaSparseMoeBlock\): its router is an MLP"):
        fh.patch(model)
    assert not fh.is_patched(model)


def test_table_is_consistent():
    for f in fh.FAMILIES:
        assert f.refused or (f.routing in fam_table.ROUTINGS and f.config), f.name
        assert fh.family(f.model_type) is f
    with pytest.raises(KeyError, match="supported"):
        fh.family("not-a-model")


def test_demo_hf_cli(capsys):
    from fusedmoe.cli import main

    assert main(["demo", "--hf", "phimoe", "--tokens", "8", "--new-tokens", "2", "--scale", "1"]) == 0
    out = capsys.readouterr().out
    assert "rel. error" in out and "(ok," in out and "fusedmoe patch" in out
    assert main(["demo", "--hf", "nllb_moe"]) == 2
    assert "not supported: capacity-limited" in capsys.readouterr().out


def _block_accuracy(model_type: str, device: str, scale: int) -> tuple[float, float]:
    """(error of transformers' bf16 block, error of the patched bf16 block) against the block in
    float32, on the same random hidden states; one MoE block of a model built at `scale`."""
    model32 = build(model_type, scale=scale, device=device)
    model16 = build(model_type, scale=scale, device=device, dtype=torch.bfloat16)
    block32 = next(m for m in model32.modules() if _is_block(m))
    block16 = next(m for m in model16.modules() if _is_block(m))
    hidden = model32.config.get_text_config().hidden_size
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 64, hidden, generator=g).to(device)
    # a hash router (DeepSeek-V4's first layers) picks by the block's input_ids
    vocab = model32.config.get_text_config().vocab_size
    kw = dict(input_ids=torch.randint(0, vocab, (1, 64), generator=g).to(device)) if fh.family(model_type).hash_table else {}
    with torch.no_grad():
        want = _first(block32(x, **kw)).double()
        theirs = _first(block16(x.bfloat16(), **kw)).double()
        fh.patch(model16)
        ours = _first(block16(x.bfloat16(), **kw)).double()
    return rel_err(theirs, want), rel_err(ours, want)


def _is_block(module) -> bool:
    from fusedmoe.hf.patch import block_family

    return block_family(module) is not None


def _first(out):
    return out[0] if isinstance(out, tuple) else out


@pytest.mark.gpu
@pytest.mark.parametrize("model_type", installed(SUPPORTED))
def test_patched_block_bf16_gpu(model_type):
    """bf16 on the GPU at hidden 1024: the patched block is at least as close to the float32 block
    as transformers' own bf16 block (whole-model logits are not compared in bf16: a rounding
    difference can flip a near-tie routing decision in a later layer)."""
    theirs, ours = _on_a_supported_transformers(model_type, lambda: _block_accuracy(model_type, "cuda", scale=16))
    # ~6e-3 for both on CPU at hidden 512; PhiMoE ~6e-2 for both (its SparseMixer margin test
    # flips in bf16, transformers' as well).
    assert ours <= 1.5 * theirs + 1e-3, (ours, theirs)


# Realistic MoE layers for the bf16 generate test: each family's real top-k (and expert groups),
# its real expert count up to 32; with scale=16, hidden 1024 and expert intermediate 512.
REAL_MOE = {
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2),  # Mixtral-8x7B
    "minimax": dict(num_local_experts=32, num_experts_per_tok=2),  # MiniMax-Text-01
    "minimax_m2": dict(num_local_experts=32, num_experts_per_tok=8),  # MiniMax-M2: 256
    "minimax_m3_vl_text": dict(num_local_experts=32, num_experts_per_tok=4, swiglu_limit=7.0),  # MiniMax-M3: 128
    "qwen2_moe": dict(num_experts=32, num_experts_per_tok=4),  # Qwen1.5-MoE-A2.7B: 60
    "qwen3_moe": dict(num_experts=32, num_experts_per_tok=8),  # Qwen3-30B-A3B: 128
    "qwen3_next": dict(num_experts=32, num_experts_per_tok=10),  # Qwen3-Next-80B-A3B: 512
    "qwen4_exp_text": dict(num_experts=32, num_experts_per_tok=10),  # transformers' default: 512
    "qwen3_vl_moe_text": dict(text_config=dict(num_experts=32, num_experts_per_tok=8)),  # Qwen3-VL-30B-A3B: 128
    "qwen3_5_moe_text": dict(num_experts=32, num_experts_per_tok=8),  # transformers' default: 256
    "qwen3_omni_moe_text": dict(text_config=dict(num_experts=32, num_experts_per_tok=8)),  # Qwen3-Omni-30B-A3B: 128
    "olmoe": dict(num_experts=32, num_experts_per_tok=8),  # OLMoE-1B-7B: 64
    "inkling_text": dict(n_routed_experts=32, num_experts_per_tok=6),  # transformers' default: 256 (+ 2 shared)
    "flint": dict(num_experts=32, num_experts_per_tok=6),  # transformers' default: 256
    "hy_v3": dict(num_local_experts=32, num_experts_per_tok=8),
    "afmoe": dict(num_experts=32, num_experts_per_tok=8),
    "laguna": dict(num_experts=32, num_experts_per_tok=8),  # transformers' default: 256
    "cohere2_moe": dict(num_experts=8, num_experts_per_tok=2),  # transformers' default
    "kolibri1": dict(num_experts=32, num_experts_per_tok=8),
    "lfm2_moe": dict(num_experts=32, num_experts_per_tok=4),  # LFM2-8B-A1B
    "deepseek_v2": dict(n_routed_experts=32, num_experts_per_tok=6, n_group=8, topk_group=3),  # 160
    "deepseek_v3": dict(n_routed_experts=32, num_experts_per_tok=8, n_group=8, topk_group=4),  # 256
    "deepseek_ocr2_text": dict(text_config=dict(n_routed_experts=32, num_experts_per_tok=6,
                                                topk_method="greedy")),  # transformers' default: 64
    "unlimited_ocr_text": dict(text_config=dict(n_routed_experts=32, num_experts_per_tok=6)),  # default: 64
    "glm4_moe": dict(n_routed_experts=32, num_experts_per_tok=8, n_group=1, topk_group=1),  # GLM-4.5
    "glm4v_moe_text": dict(text_config=dict(n_routed_experts=32, num_experts_per_tok=8, n_group=1,
                                            topk_group=1)),  # GLM-4.5V: 128
    "mistral4": dict(n_routed_experts=32, num_experts_per_tok=4, n_group=4, topk_group=2),  # 128, 1 group
    "mistral_large4_text": dict(text_config=dict(n_routed_experts=32, num_experts_per_tok=4, n_group=4,
                                                 topk_group=2)),  # 128, 1 group
    "dots3_note_text": dict(n_routed_experts=32, num_experts_per_tok=8, n_group=1, topk_group=1),  # 256
    "glm5_next_text": dict(text_config=dict(n_routed_experts=32, num_experts_per_tok=8, n_group=1, topk_group=1,
                                            swiglu_limit=10.0)),  # 288
    "kimi_linear": dict(num_experts=32, num_experts_per_token=8, num_expert_group=1, topk_group=1),  # 256
    "axk1": dict(n_routed_experts=32, num_experts_per_tok=8, n_group=8, topk_group=4),
    "axk2": dict(n_routed_experts=32, num_experts_per_tok=8),  # A.X-K2-Light: 128, no groups
    "bailing_hybrid": dict(num_experts=32, num_experts_per_tok=8, n_group=8, topk_group=4),  # default: 512
    "beam": dict(num_experts=32, num_experts_per_tok=8, n_group=8, topk_group=4),  # transformers' default: 256
    "hy_v4": dict(n_routed_experts=32, num_experts_per_tok=8, swiglu_limit=10.0),  # transformers' default: 256
    "deepseek_v4": dict(n_routed_experts=32, num_experts_per_tok=6, swiglu_limit=10.0),  # DeepSeek-V4-Flash: 256
    "hy_v4_vl_text": dict(text_config=dict(n_routed_experts=32, num_experts_per_tok=8, n_group=1, topk_group=1,
                                           swiglu_limit=10.0)),  # transformers' default: 256, 1 group
    "deepseek_v32": dict(n_routed_experts=32, num_experts_per_tok=8, n_group=8, topk_group=4),  # 256
    "dots1": dict(n_routed_experts=32, num_experts_per_tok=6, n_group=1, topk_group=1),  # dots.llm1: 128
    "glm4_moe_lite": dict(n_routed_experts=32, num_experts_per_tok=4),  # GLM-4.7-Flash: 64
    "glm_moe_dsa": dict(n_routed_experts=32, num_experts_per_tok=8),  # 256
    "solar_open": dict(n_routed_experts=32, num_experts_per_tok=8),  # Solar-Open-100B: 128
    "exaone_moe": dict(num_experts=32, num_experts_per_tok=8),  # transformers' default: 64
    "mimo_v2_flash": dict(n_routed_experts=32, num_experts_per_tok=8),  # MiMo-V2-Flash: 256
    "mellum": dict(num_experts=32, num_experts_per_tok=8),  # transformers' default: 64
    "lara_mini": dict(num_experts=32, num_experts_per_tok=4),  # transformers' default: 128
    "flex_olmo": dict(num_experts=7, num_experts_per_tok=5),  # FlexOlmo-7x7B
    "granitemoe_swa": dict(num_local_experts=8, num_experts_per_tok=2),  # transformers' default
    "nemotron_h": dict(n_routed_experts=32, num_experts_per_tok=6, n_group=1, topk_group=1),
    "gpt_oss": dict(num_local_experts=32, num_experts_per_tok=4),  # gpt-oss-20b
    "granitemoe": dict(num_local_experts=32, num_experts_per_tok=8),  # Granite-3.0-3B-A800M: 40
    "granitemoeshared": dict(num_local_experts=32, num_experts_per_tok=8),
    "granitemoehybrid": dict(num_local_experts=32, num_experts_per_tok=6),  # Granite-4.0-H-Tiny: 64
    "phimoe": dict(num_local_experts=16, num_experts_per_tok=2),  # Phi-3.5-MoE
    "jamba": dict(num_experts=16, num_experts_per_tok=2),  # Jamba
    "jetmoe": dict(num_local_experts=8, num_experts_per_tok=2),  # JetMoE-8B
    "longcat_flash": dict(n_routed_experts=32, zero_expert_num=16, num_experts_per_tok=12),  # LongCat-Flash: 512 + 256
    "hunyuan_v1_moe": dict(num_experts=32, moe_topk=8),  # Hunyuan-A13B: 64
    "ernie4_5_moe": dict(moe_num_experts=32, moe_k=6),  # ERNIE-4.5-21B-A3B: 64
    "ernie4_5_vl_moe_text": dict(text_config=dict(moe_num_experts=32, moe_k=6)),  # ERNIE-4.5-VL-28B-A3B: 64
    "aria_text": dict(moe_num_experts=32, moe_topk=6),  # Aria: 64
    "llama4_text": dict(num_local_experts=16, num_experts_per_tok=1),  # Llama-4-Scout
    "dbrx": dict(ffn_config=dict(ffn_hidden_size=512, moe_num_experts=16, moe_top_k=4,  # DBRX
                                 moe_normalize_expert_weights=1.0)),
}


def test_real_moe_sizes_cover_every_family():
    """The GPU generate test's table: every supported family, and its overrides reach the config."""
    assert set(REAL_MOE) == set(SUPPORTED)
    for model_type, overrides in REAL_MOE.items():
        if not hasattr(transformers, fh.family(model_type).config):  # newer than this transformers
            continue
        config = tiny_config(model_type, scale=16, **overrides).get_text_config()
        for key, value in overrides.items():
            got = config if key == "text_config" else getattr(config, key)
            for sub, want in value.items() if isinstance(value, dict) else [(None, value)]:
                assert (got if sub is None else getattr(got, sub)) == want, (model_type, key, sub)


def _row_errors(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Relative error of each row of logits [..., V]."""
    got, want = got.double().flatten(0, -2), want.double().flatten(0, -2)
    return (got - want).norm(dim=-1) / want.norm(dim=-1)


def _generate_accuracy(model_type: str, device: str, scale: int, batch: int = 16,
                       prompt_len: int = 16) -> dict[str, tuple[float, float]]:
    """{"prefill" | "step s": (transformers' error, patched error)}: the median over rows of the
    relative error of bf16 logits against the float32 model (same weights) fed the same tokens;
    prefill = every position of the prompt, step s = `generate`'s logits of greedy step s (step 0
    is the prefill's last position, then decode steps with the KV cache)."""
    model32 = build(model_type, scale=scale, device=device, **REAL_MOE[model_type])
    model16 = copy.deepcopy(model32).to(torch.bfloat16)
    vocab = model32.config.get_text_config().vocab_size
    # From 1: id 0 is the padding index of some families (a zero embedding, all-zero logits).
    ids = torch.randint(1, vocab, (batch, prompt_len), generator=torch.Generator().manual_seed(5))
    ids = ids.to(device)

    def run16():
        with torch.no_grad():
            prefill = model16(ids).logits
            gen = model16.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True,
                return_dict_in_generate=True, pad_token_id=0,
            )
        return prefill, gen.sequences, torch.stack(gen.logits, dim=1)  # steps [B, N, V]

    runs = {"theirs": run16()}
    fh.patch(model16)
    runs["ours"] = run16()
    errors = {}
    with torch.no_grad():
        want_prefill = model32(ids).logits
        for name, (prefill, seq, steps) in runs.items():
            # Each run against the float32 model fed its own greedy tokens: bf16 runs may pick
            # different tokens at a near tie, and then continue from different prefixes.
            want_steps = model32(seq).logits[:, prompt_len - 1 : prompt_len - 1 + NEW_TOKENS]
            errors[name] = [_row_errors(prefill, want_prefill).median().item()] + [
                _row_errors(steps[:, s], want_steps[:, s]).median().item() for s in range(NEW_TOKENS)
            ]
    names = ["prefill"] + [f"step {s}" for s in range(NEW_TOKENS)]
    return {n: (t, o) for n, t, o in zip(names, errors["theirs"], errors["ours"], strict=True)}


@pytest.mark.gpu
@pytest.mark.parametrize("model_type", installed(SUPPORTED))
def test_patched_generate_bf16_gpu(model_type):
    """bf16 on the GPU, 2 layers with a realistic MoE layer (`REAL_MOE`): prefill logits and 4
    greedy `generate` steps of the patched model are as close to the float32 model as
    transformers' own bf16 model is, per step. Medians over the 16 rows (sequences) of a step:
    after the first MoE layer the two bf16 runs differ by rounding, so the second can flip a
    near-tie routing decision in a few rows (an outlier row each), transformers' as well."""
    errors = _on_a_supported_transformers(model_type, lambda: _generate_accuracy(model_type, "cuda", scale=16))
    # CPU, this helper at scale 16 (every family): medians 0.9-4.6e-2 (mostly attention and
    # lm_head rounding, common to both), ours / theirs <= 1.21; noise of 1% / 3% of the experts'
    # output std added to ours gives ~1.5x / ~3x.
    for name, (theirs, ours) in errors.items():
        assert ours <= 1.5 * theirs + 1e-3, (name, errors)


def test_hf_experts_op_opcheck():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 16, generator=g)
    w13, w2 = torch.randn(4, 16, 16, generator=g), torch.randn(4, 16, 8, generator=g)
    ids = torch.tensor([[0, 1], [2, 3], [1, 2], [3, 0], [0, 2]])
    weights = torch.rand(5, 2, generator=g)
    torch.library.opcheck(
        torch.ops.fusedmoe.hf_experts.default,
        (x, w13, w2, weights, ids, None, None, None, None, None, "", "silu", 1.702, None, False, -1),
    )


@pytest.mark.parametrize("model_type", ["gpt_oss", "llama4_text", "dbrx", "aria_text"])
def test_conversion_keeps_one_copy(model_type):
    """Re-laid-out families: the converted tensors replace the originals (same parameter bytes,
    same names except DBRX's w1 + v1 -> w13), and unpatch restores names and shapes."""
    model = build(model_type)

    def params():
        return {n: (tuple(p.shape), p.numel() * p.element_size()) for n, p in model.named_parameters()}

    before = params()
    fh.patch(model)
    during = params()
    assert sum(b for _, b in during.values()) == sum(b for _, b in before.values())
    renamed = {n.replace(".w1", ".w13") for n in before if n.endswith("mlp.w1")}
    assert set(during) == (set(before) - {n for n in before if n.endswith(("mlp.w1", "mlp.v1"))}) | renamed
    fh.unpatch(model)
    assert params() == before


VARIANTS = [  # config switches the default tiny configs do not take
    ("deepseek_v2", dict(topk_method="greedy")),
    ("qwen2_moe", dict(norm_topk_prob=True)),
    ("qwen3_moe", dict(norm_topk_prob=False)),
    ("olmoe", dict(norm_topk_prob=True)),
    ("deepseek_v3", dict(norm_topk_prob=False, n_group=1, topk_group=1)),
    # The group limit binds: 1 group of 4 (2 experts each) for top-2. With the tiny configs'
    # topk_group=2 it rarely changes the pick (never for DeepSeek-V2's group max).
    ("deepseek_v2", dict(topk_group=1)),
    ("deepseek_v3", dict(topk_group=1)),
    ("ernie4_5_moe", dict(moe_norm_min=0.9)),  # the clamp binds: top-2 of 4 sums to >= 0.5
    ("hunyuan_v1_moe", dict(moe_topk=[1, 3])),  # per-layer top-k list
    ("nemotron_h", dict(moe_latent_size=16)),  # latent projections around the experts
    ("gpt_oss", dict(swiglu_limit=0.5)),  # the clamp binds
    ("lfm2_moe", dict(use_expert_bias=False)),  # no selection bias
    ("kolibri1", dict(norm_topk_prob=False)),
    ("flint", dict(norm_topk_prob=False)),
    ("laguna", dict(moe_router_logit_softcapping=0.0)),  # no softcap (the tiny config's binds)
    ("cohere2_moe", dict(shared_expert_combination_strategy="sum")),  # the tiny config averages
    ("cohere2_moe", dict(num_shared_experts=0)),  # no shared_experts module
    ("cohere2_moe", dict(expert_selection_fn="sigmoid")),
    ("cohere2_moe", dict(expert_selection_fn="sigmoid", norm_topk_prob=False)),
    ("mistral4", dict(topk_group=1)),  # the group limit binds: a group's max would pick other experts
    ("mistral_large4_text", dict(text_config=dict(topk_group=1))),
    ("hy_v4", dict(swiglu_limit=100.0)),
    ("glm5_next_text", dict(text_config=dict(swiglu_limit=100.0))),  # the tiny config's clamp (0.5) binds; this one does not
    ("lfm2_moe", dict(norm_topk_prob=False)),
    ("deepseek_v4", dict(scoring_func="sigmoid")),
    ("deepseek_v4", dict(mlp_layer_types=["moe", "moe"], swiglu_limit=100.0)),  # no hash layer, no clamp binding
    ("axk2", dict(n_group=4, topk_group=2)),  # grouped (the larger A.X-K2 releases)
    ("axk2", dict(n_group=4, topk_group=1)),  # the group limit binds
    ("axk2", dict(norm_topk_prob=False)),
    ("bailing_hybrid", dict(topk_group=1)),
    ("beam", dict(topk_group=1)),
    ("beam", dict(norm_topk_prob=False)),
    ("inkling_text", dict(n_shared_experts=1)),
    ("deepseek_ocr2_text", dict(text_config=dict(topk_method="greedy"))),
    ("unlimited_ocr_text", dict(text_config=dict(topk_method="group_limited_greedy", n_group=4, topk_group=1))),
    ("longcat_flash", dict(router_bias=True)),  # a classifier bias its router's forward never adds
    ("longcat_flash", dict(zero_expert_num=0)),  # no identity experts
    ("qwen3_omni_moe_text", dict(text_config=dict(norm_topk_prob=False))),
    ("minimax_m3_vl_text", dict(swiglu_limit=100.0)),  # the tiny config's clamp (0.5) binds; this one does not
    ("hy_v4_vl_text", dict(text_config=dict(swiglu_limit=100.0))),
    ("ernie4_5_vl_moe_text", dict(text_config=dict(moe_norm_min=0.9))),  # the clamp binds
]


@pytest.mark.parametrize(("model_type", "overrides"), [
    pytest.param(t, o, marks=p.marks) for (t, o), p in zip(VARIANTS, installed([t for t, _ in VARIANTS]), strict=True)
], ids=[f"{t}-{next(iter(o))}" for t, o in VARIANTS])
def test_patch_variants(model_type, overrides):
    model = build(model_type, **overrides)
    ids = prompt()
    with torch.no_grad():
        want = model(ids).logits
        fh.patch(model)
        assert rel_err(model(ids).logits, want) < RTOL


@pytest.mark.parametrize("model_type", ["deepseek_v2", "deepseek_v3"])
def test_group_limit_changes_transformers_logits(model_type):
    """The topk_group=1 variants have teeth: transformers' own logits move when every group is
    allowed (same weights), so a patch that ignored the group limit would fail them."""
    ids = prompt()
    with torch.no_grad():
        limited = build(model_type, topk_group=1)(ids).logits
        n_group = tiny_config(model_type).n_group
        unlimited = build(model_type, topk_group=n_group)(ids).logits
    assert rel_err(unlimited, limited) > 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("model_type", ["mixtral", "deepseek_v3", "gpt_oss", "llama4_text", "dbrx"])
def test_patched_block_captures_and_compiles_gpu(model_type):
    """A patched block in bf16 on the GPU replays as a CUDA graph and compiles with fullgraph."""
    model = build(model_type, scale=16, device="cuda", dtype=torch.bfloat16)
    block = next(m for m in model.modules() if _is_block(m))
    hidden = model.config.get_text_config().hidden_size
    x = torch.randn(1, 16, hidden, device="cuda", dtype=torch.bfloat16)
    fh.patch(model)
    with torch.no_grad():
        want = _first(block(x)).clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            _first(block(x))  # warm-up outside capture (Triton JIT, tile lookup)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = _first(block(x))
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(out, want) < 1e-6
        compiled = torch.compile(block, fullgraph=True)
        assert rel_err(_first(compiled(x)), want) < 1e-2  # inductor may reorder bf16 router math


@pytest.mark.gpu
@pytest.mark.parametrize("model_type", ["qwen3_moe", "deepseek_v3", "nemotron_h"])
def test_experts_hook_bf16_gpu(model_type):
    """experts_implementation="fusedmoe" on the GPU: as close to the fp32 model as transformers'."""
    model32 = build(model_type, scale=16, device="cuda")
    model16 = build(model_type, scale=16, device="cuda", dtype=torch.bfloat16)
    ids = prompt().cuda()
    with torch.no_grad():
        want = model32(ids).logits.double()
        theirs = rel_err(model16(ids).logits, want)
        model16.set_experts_implementation("fusedmoe")
        ours = rel_err(model16(ids).logits, want)
    assert ours <= 1.5 * theirs + 1e-3, (ours, theirs)


CUSTOM_GATES = [  # experts classes with their own _apply_gate that the hook knows (clamp binds)
    ("deepseek_v4", "DeepseekV4Experts", "DeepseekV4Config",
     dict(hidden_size=64, moe_intermediate_size=32, n_routed_experts=4, swiglu_limit=0.5)),
    ("glm5_next", "Glm5NextTextExperts", "Glm5NextTextConfig",
     dict(hidden_size=64, moe_intermediate_size=32, n_routed_experts=4, swiglu_limit=0.5)),
    ("minimax_m3_vl", "MiniMaxM3VLExperts", "MiniMaxM3VLTextConfig",
     dict(hidden_size=64, intermediate_size=32, num_local_experts=4, swiglu_limit=0.5, swiglu_alpha=1.702)),
    ("hy_v4", "HYV4Experts", "HYV4Config",
     dict(hidden_size=64, moe_intermediate_size=32, n_routed_experts=4, swiglu_limit=0.5)),
    ("hy_v4_vl", "HYV4VLExperts", "HYV4VLTextConfig",
     dict(hidden_size=64, moe_intermediate_size=32, n_routed_experts=4, swiglu_limit=0.5)),
]


NO_BLOCK = [  # experts of families patch() refuses for having no MoE block module: the hook runs them
    ("gemma4", "Gemma4TextExperts", "Gemma4TextConfig",
     dict(hidden_size=64, moe_intermediate_size=32, num_experts=4, top_k_experts=2, enable_moe_block=True)),
    ("diffusion_gemma", "DiffusionGemmaTextExperts", "DiffusionGemmaTextConfig",
     dict(hidden_size=64, moe_intermediate_size=32, num_experts=4, top_k_experts=2)),
]


@pytest.mark.parametrize(("module", "experts_cls", "config_cls", "kwargs"), CUSTOM_GATES + NO_BLOCK,
                         ids=[c[0] for c in CUSTOM_GATES + NO_BLOCK])
def test_experts_hook_modules(module, experts_cls, config_cls, kwargs, hook_calls):
    from importlib import import_module

    modeling = import_module(f"transformers.models.{module}.modeling_{module}")
    config = getattr(import_module(f"transformers.models.{module}.configuration_{module}"), config_cls)(**kwargs)
    experts = getattr(modeling, experts_cls)(config)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    x = torch.randn(6, 64, generator=g)
    ids = torch.randint(0, 4, (6, 2), generator=g)
    weights = torch.rand(6, 2, generator=g)
    config._experts_implementation = "eager"
    want = experts(x, ids, weights)
    config._experts_implementation = "fusedmoe"
    assert rel_err(experts(x, ids, weights), want) < RTOL
    assert hook_calls == [experts_cls]


def test_quantized_experts_in_a_converted_layout_are_refused():
    model = build("llama4_text")
    experts = model.model.layers[0].feed_forward.experts
    experts.gate_up_proj.data = experts.gate_up_proj.data.to(torch.float8_e4m3fn)
    with pytest.raises(fh.UnsupportedModel, match=r"quantized experts \(torch.float8_e4m3fn\) in the transposed"):
        fh.patch(model)
    assert not fh.is_patched(model)


def _hf_bench():
    from importlib.util import module_from_spec, spec_from_file_location
    from pathlib import Path

    spec = spec_from_file_location("hf_bench", Path(__file__).parents[1] / "benchmarks" / "hf_bench.py")
    module = module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_hf_bench_modes_and_like_for_like_speedups(capsys):
    """benchmarks/hf_bench.py without a GPU: its modes per family, and speed-ups that compare
    eager-launched rows with transformers' eager-launched modes and +graph rows with +graph."""
    bench = _hf_bench()
    assert bench.modes_for(fh.family("mixtral"), graph=False) == [
        "eager", "batched_mm", "grouped_mm", "fusedmoe", "patch", "patch-cg"]
    assert bench.modes_for(fh.family("mixtral"), graph=True)[6:] == [
        "batched_mm+graph", "grouped_mm+graph", "fusedmoe+graph", "patch+graph"]
    assert bench.modes_for(fh.family("gpt_oss"), graph=True) == [
        "eager", "batched_mm", "grouped_mm", "patch", "patch-cg", "batched_mm+graph", "grouped_mm+graph",
        "patch+graph"]
    assert bench.modes_for(fh.family("llama4_text"), graph=True) == [
        "eager", "patch", "patch-cg", "eager+graph", "patch+graph"]
    order = bench.run_order(bench.modes_for(fh.family("qwen3_moe"), graph=True))
    assert order[0] == "eager" and order[-3:] == ["patch", "patch-cg", "patch+graph"]
    assert bench.launch("patch-cg") == "eager"  # its speed-ups are against transformers' eager launches

    us = {"eager": 800.0, "batched_mm": 600.0, "grouped_mm": 500.0, "patch": 400.0,
          "batched_mm+graph": 300.0, "patch+graph": 100.0}
    rows = [dict(family="Mixtral", tokens=1, mode=m, us=t, rel_err=0.0) for m, t in us.items()]
    rows.insert(5, dict(family="Mixtral", tokens=1, mode="grouped_mm+graph", us=math.nan,
                        error="CaptureError: capture failed: RuntimeError: ..."))
    bench.add_speedups(rows)
    by_mode = {r["mode"]: r for r in rows}
    assert by_mode["patch"]["speedup_vs_grouped_mm"] == 500 / 400
    assert by_mode["patch"]["speedup_vs_eager"] == 2.0 and by_mode["patch"]["best_hf"] == "grouped_mm"
    graph_row = by_mode["patch+graph"]  # against batched_mm+graph, not the eager-launched modes
    assert graph_row["speedup_vs_best_hf"] == 3.0 and graph_row["best_hf"] == "batched_mm+graph"
    assert math.isnan(graph_row["speedup_vs_grouped_mm"]) and math.isnan(graph_row["speedup_vs_eager"])
    assert "speedup_vs_eager" not in by_mode["grouped_mm+graph"]
    text = bench.format_rows(rows)
    assert "grouped_mm+graph  error: CaptureError" in text and "3.00x  batched_mm+graph" in text
    if not torch.cuda.is_available():
        assert bench.main(["--families", "mixtral"]) == 2
        assert "needs a CUDA device" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.parametrize("model_type", ["qwen3_moe", "gpt_oss", "llama4_text", "deepseek_v3"])
def test_block_cuda_graphs_gpu(model_type):
    """patch(model, cuda_graphs=True): a block's input runs eagerly once, is captured the second
    time and replayed after, each call on fresh values, bit for bit the eager block's output
    (tuples too); moved weights are captured again; gradients, more tokens than the limit and
    FUSEDMOE_VALIDATE run eagerly."""
    from fusedmoe.hf.patch import _fused_forward_eager

    model = build(model_type, scale=16, device="cuda", dtype=torch.bfloat16)
    hidden = model.config.get_text_config().hidden_size
    block = next(m for m in model.modules() if _is_block(m))
    fh.patch(model, cuda_graphs=4)
    graphs = block._fusedmoe_patch.graphs
    gen = torch.Generator(device="cuda").manual_seed(0)

    def check(tokens: int, calls: int = 4) -> None:
        for _ in range(calls):
            x = torch.randn(1, tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
            got, want = block(x), _fused_forward_eager(block, x)
            for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,),
                            strict=True):
                assert torch.equal(g, w)

    with torch.no_grad():
        check(3)
        assert len(graphs.graphs) == 1 and next(iter(graphs.graphs.values())).graph is not None
        check(1)
        assert len(graphs.graphs) == 2
        experts = block._fusedmoe_patch.family.experts_of(block)
        name, param = next((n, p) for n, p in experts.named_parameters() if p.dim() == 3)
        key3 = next(k for k in graphs.graphs if k[0][1] == 3)
        old = graphs.graphs[key3].weights
        setattr(experts, name, torch.nn.Parameter(param.detach() * 1.5, requires_grad=False))  # new storage
        check(3)
        assert graphs.graphs[key3].graph is not None and graphs.graphs[key3].weights != old
        check(5, calls=2)  # more than max_tokens: eager
        with knobs.override(VALIDATE=True):
            check(2, calls=2)
    assert all(k[0][1] in (1, 3) for k in graphs.graphs)
    x = torch.randn(1, 2, hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
    block(x), block(x)  # gradients enabled: eager
    assert all(k[0][1] in (1, 3) for k in graphs.graphs)


@pytest.mark.gpu
def test_generate_with_block_cuda_graphs_gpu():
    """Greedy generate of a patched model with and without block graphs: the same tokens and
    logits (decode steps replay, the prefill of 7 tokens per sequence too)."""
    model = build("qwen3_moe", scale=16, device="cuda", dtype=torch.bfloat16)
    blocks = [m for m in model.modules() if _is_block(m)]
    fh.patch(model)
    ids = prompt().cuda()
    want = run(model, ids)
    fh.unpatch(model)
    fh.patch(model, cuda_graphs=True)
    run(model, ids)  # first sightings and captures
    got = run(model, ids)
    (logits, seq, steps), (ref_logits, ref_seq, ref_steps) = got, want
    assert torch.equal(logits, ref_logits) and torch.equal(seq, ref_seq) and torch.equal(steps, ref_steps)
    assert blocks and all(any(e.graph is not None for e in b._fusedmoe_patch.graphs.graphs.values())
                          for b in blocks)


def test_activation_functions_as_act_fn():
    """Experts whose act_fn is a torch function (LFM2-MoE: F.silu) map like the modules; another
    function is refused by its name."""
    import torch.nn.functional as F

    from fusedmoe.hf.experts import UnsupportedModel, activation_of

    assert activation_of(F.silu, gated=True, where="E") == "silu"
    assert activation_of(F.gelu, gated=False, where="E") == "gelu_no_mul"
    assert activation_of(torch.nn.SiLU(), gated=True, where="E") == "silu"
    with pytest.raises(UnsupportedModel, match=r"E: activation (torch\.)?tanh as a gated"):
        activation_of(torch.tanh, gated=True, where="E")
    with pytest.raises(UnsupportedModel, match=r"E: activation torch\.nn\.functional\.mish as a gated"):
        activation_of(F.mish, gated=True, where="E")


def test_cohere2_moe_unknown_strategies_are_refused():
    """A shared-expert combination or expert selection the patch does not know refuses the block
    before anything changes."""
    for attribute, value in (("shared_expert_combination_strategy", "max"), ("expert_selection_fn", "relu")):
        model = build("cohere2_moe")
        for module in model.modules():
            if type(module).__name__ == "Cohere2MoeSparseMoeBlock":
                setattr(module if attribute.startswith("shared") else module.gate, attribute, value)
        with pytest.raises(fh.UnsupportedModel, match=rf"Cohere2-MoE: {attribute}='{value}' is not supported"):
            fh.patch(model)
        assert not fh.is_patched(model)


def test_ernie4_5_vl_vision_tokens():
    """Ernie-4.5-VL: tokens marked as vision tokens (moe_mm_token_type_ids) go through the patched
    vision block, the others through the text block (transformers' modality block splits them):
    logits, router logits and aux loss as transformers', and the vision experts matter."""
    model = build("ernie4_5_vl_moe_text")
    ids = prompt()
    vision = torch.zeros_like(ids)
    vision[0, 2:5] = vision[1, 4:] = 1
    with torch.no_grad():
        want = model(ids, moe_mm_token_type_ids=vision, output_router_logits=True)
        assert rel_err(model(ids).logits, want.logits) > 1e-3  # the vision blocks change the logits
        fh.patch(model)
        got = model(ids, moe_mm_token_type_ids=vision, output_router_logits=True)
        assert rel_err(got.logits, want.logits) < RTOL
        assert len(got.router_logits) == len(want.router_logits) == 2
        for g, w in zip(got.router_logits, want.router_logits, strict=True):
            assert rel_err(g, w) < RTOL
        assert rel_err(got.aux_loss, want.aux_loss) < RTOL
        model.model.language_model.layers[0].mlp.vision_moe.experts.gate_up_proj.mul_(-1)
        assert rel_err(model(ids, moe_mm_token_type_ids=vision).logits, got.logits) > 1e-3


@pytest.mark.parametrize("model_type", installed(list(TEXT_MODEL_ONLY)))
def test_text_model_only_families_are_not_built_as_language_models(model_type):
    """`build` (and so `fusedmoe demo --hf`) names why such a family has no model to run, instead
    of transformers' list of every config class its auto classes take."""
    with pytest.raises(ValueError, match=rf"^{model_type}: transformers has no causal-LM or image-text-to-text model"):
        build(model_type)


@pytest.mark.parametrize("model_type", installed(list(TEXT_MODEL_ONLY)))
def test_text_model_only_families(model_type, hook_calls):
    """Qwen3-Omni-MoE's talker (its text model on embeddings: the talker's generation needs the
    thinker's hidden states): prefill and two cached decode steps, patched, hooked and as
    transformers, router logits included, and the experts matter."""
    from importlib import import_module

    from fusedmoe.hf.models import redraw_moe

    modeling = import_module(fh.family(model_type).module_path)
    torch.manual_seed(0)
    model = redraw_moe(getattr(modeling, TEXT_MODEL_ONLY[model_type])(tiny_config(model_type)), seed=1).eval()
    g = torch.Generator().manual_seed(0)
    embeds = [torch.randn(2, n, 64, generator=g) for n in (7, 1, 1)]

    def run_model():
        cache, out = None, []
        with torch.no_grad():
            for x in embeds:
                step = model(inputs_embeds=x, cache=cache, use_cache=True, output_router_logits=True)
                cache = step.cache
                out.append((step.last_hidden_state, step.router_logits))
        return out

    def check(got, want):
        for (hidden, logits), (ref_hidden, ref_logits) in zip(got, want, strict=True):
            assert rel_err(hidden, ref_hidden) < RTOL
            assert len(logits) == len(ref_logits) > 0
            assert all(rel_err(a, b) < RTOL for a, b in zip(logits, ref_logits, strict=True))

    want = run_model()
    model.set_experts_implementation("fusedmoe")
    check(run_model(), want)
    assert hook_calls
    model.set_experts_implementation("eager")
    block = next(m for m in model.modules() if _is_block(m))
    patched = fh.patch(model)
    assert patched and all(name == fh.family(model_type).name for _, name in patched)
    check(run_model(), want)
    block.experts.gate_up_proj.data.mul_(-1)
    assert rel_err(run_model()[0][0], want[0][0]) > 1e-3
