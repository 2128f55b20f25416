"""The mixture-of-experts MLP equals transformers' sparse blocks (routing, renormalisation, dtype
casts) and runs each chosen expert once per step, over all its tokens together."""
import pytest
import torch
from transformers import MixtralConfig, Qwen3MoeConfig
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from pdserve.engine.loading.weights import load_model_config
from pdserve.engine.model.decoder import CausalLM
from pdserve.engine.model.layers import GatedMLP
from pdserve.engine.model.moe import MoeMLP

SHAPE = dict(hidden_size=32, intermediate_size=24, moe_intermediate_size=24, num_experts_per_tok=2)


def hf_block(kind: str, normalize: bool, dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "mixtral":
        block = MixtralSparseMoeBlock(MixtralConfig(num_local_experts=6, **SHAPE))
    else:
        block = Qwen3MoeSparseMoeBlock(Qwen3MoeConfig(num_experts=6, norm_topk_prob=normalize, **SHAPE))
    for parameter in block.parameters():
        torch.nn.init.normal_(parameter, std=0.3)
    return block.to(dtype).eval()


def ours(block: torch.nn.Module, kind: str, normalize: bool) -> MoeMLP:
    experts = [GatedMLP(gate_up, down) for gate_up, down in zip(block.experts.gate_up_proj.data,
                                                                 block.experts.down_proj.data)]
    return MoeMLP(block.gate.weight.data, experts, top_k=2, normalize_top_k=normalize,
                  weights_in_float32=kind == "mixtral")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind, normalize", [("mixtral", True), ("qwen3_moe", True), ("qwen3_moe", False)])
def test_equals_the_transformers_block(kind, normalize, dtype):
    block = hf_block(kind, normalize, dtype)
    x = torch.randn(37, 32, generator=torch.Generator().manual_seed(1)).to(dtype)
    with torch.no_grad():
        expected = block(x.unsqueeze(0))[0]
    got = ours(block, kind, normalize)(x)
    assert got.dtype == dtype
    exact = dtype == torch.bfloat16  # the same roundings, in the same order, as transformers'
    torch.testing.assert_close(got, expected, atol=0 if exact else 1e-5, rtol=0 if exact else 1e-5)


def test_renormalisation_changes_the_output():
    """Guards the test above: with and without renormalisation the outputs differ."""
    block = hf_block("qwen3_moe", True, torch.float32)
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(2))
    assert not torch.allclose(ours(block, "qwen3_moe", True)(x), ours(block, "qwen3_moe", False)(x))


class CountingExpert:
    def __init__(self, expert: GatedMLP) -> None:
        self.expert, self.rows = expert, []

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.rows.append(x.shape[0])
        return self.expert(x)


def test_each_chosen_expert_runs_once_over_all_its_tokens():
    mlp = ours(hf_block("mixtral", True, torch.float32), "mixtral", True)
    x = torch.randn(40, 32, generator=torch.Generator().manual_seed(3))
    counts = mlp.route(x).counts
    mlp.experts = [CountingExpert(e) for e in mlp.experts]
    mlp(x)
    assert [e.rows for e in mlp.experts] == [[n] if n else [] for n in counts]
    assert sum(counts) == 40 * 2


def test_routes_sort_the_pairs_by_expert():
    mlp = ours(hf_block("qwen3_moe", False, torch.float32), "qwen3_moe", False)
    x = torch.randn(9, 32, generator=torch.Generator().manual_seed(4))
    routes = mlp.route(x)
    experts = torch.topk(torch.softmax(x @ mlp.router.T, -1), 2).indices.flatten()  # (T k,)
    assert experts[routes.order].tolist() == sorted(experts.tolist())
    assert routes.counts == torch.bincount(experts, minlength=6).tolist()


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_dropping_matrices_lets_go_of_every_expert(checkpoints, kind):
    """What the native kernels do once they hold packed copies (native_forward.py)."""
    from safetensors.torch import load_file
    path = checkpoints[kind].path
    model = CausalLM(load_model_config(str(path)), load_file(path / "model.safetensors"), torch.device("cpu"))
    router = model.layers[0].mlp.router
    model.drop_matrices()
    assert all(e.gate_up is None and e.down is None for e in model.layers[0].mlp.experts)
    assert model.layers[0].mlp.router is router
