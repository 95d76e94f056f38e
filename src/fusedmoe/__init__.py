"""fusedmoe: a fused Mixture-of-Experts layer, its reference, and the oracle that picks its kernel.

    weights, ids = select_experts(x, router_logits, top_k)      # routing
    out = fused_experts(x, w13, w2, weights, ids)               # experts, backend chosen by the oracle
    explain(MoEConfig(...))                                     # why that backend, and why not the others

Map of the package: `oracle` (selection), `backends/table.py` (every backend's requirements),
`reference.py` (the math), `routing.py`, `api.py` (functional), `layer.py` (nn.Module),
`modular.py` (prepare/finalize + experts interface), `quant/` (schemes, quantize/dequantize),
`distributed.py` / `eplb.py` / `shared.py` (expert, data and tensor parallelism; docs/parallel.md).
"""

from fusedmoe.api import fused_experts, fused_moe
from fusedmoe.backends import Backend, register_backend, unregister_backend
from fusedmoe.config import MoEConfig, ParallelConfig
from fusedmoe.errors import BackendRequestError, NoBackendError
from fusedmoe.layer import FusedMoE
from fusedmoe.oracle import Explanation, Selection, Verdict, explain, select_backend
from fusedmoe.platform import Platform
from fusedmoe.quant import QuantParams, QuantScheme
from fusedmoe.reference import fused_experts_ref
from fusedmoe.routing import select_experts
from fusedmoe.shared import SharedExperts

__version__ = "0.1.0"

__all__ = [
    "Backend",
    "BackendRequestError",
    "Explanation",
    "FusedMoE",
    "MoEConfig",
    "NoBackendError",
    "ParallelConfig",
    "Platform",
    "QuantParams",
    "QuantScheme",
    "Selection",
    "SharedExperts",
    "Verdict",
    "explain",
    "fused_experts",
    "fused_experts_ref",
    "fused_moe",
    "register_backend",
    "select_backend",
    "select_experts",
    "unregister_backend",
]
