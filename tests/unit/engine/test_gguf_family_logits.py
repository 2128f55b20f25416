"""The model served from each family's GGUF file (F32, written from a tiny HF checkpoint as
llama.cpp's converter writes it) gives transformers' teacher-forced logits for that checkpoint."""
import pytest
import torch
import transformers

from gguf_builders import make_family_source, write_hf_gguf
from model_builders import TinyCheckpoint, chunk, load_runner, prompt, run

FAMILIES = ["qwen2", "qwen3", "gemma3", "phi3", "mixtral", "qwen3_moe"]
PROMPT_LEN = 23  # past Gemma 3's window of 8; below Phi-3's original context of 64 (its short factors)
TOL = 1e-4


@pytest.fixture(scope="module")
def gguf_checkpoints(tmp_path_factory):
    """kind -> TinyCheckpoint(the GGUF file, transformers' model of the same weights)."""
    root, made = tmp_path_factory.mktemp("gguf-logits"), {}

    def make(kind: str) -> TinyCheckpoint:
        if kind not in made:
            config, tensors = make_family_source(root / kind, kind, seed=1)
            write_hf_gguf(root / f"{kind}.gguf", config, tensors)
            hf_model = transformers.AutoModelForCausalLM.from_pretrained(root / kind, dtype=torch.float32).eval()
            made[kind] = TinyCheckpoint(root / f"{kind}.gguf", hf_model)
        return made[kind]
    return make


@pytest.mark.parametrize("kind", FAMILIES)
@pytest.mark.parametrize("kernels", ["auto", "torch"])  # auto: the native kernels where they run (not MoE)
def test_gguf_model_gives_transformers_logits(gguf_checkpoints, kernels, kind):
    checkpoint = gguf_checkpoints(kind)
    ids = prompt(PROMPT_LEN, seed=1)
    [logits] = run(load_runner(checkpoint, kernels=kernels), chunk("r", ids, 0, [5, 0, 3, 1, 4, 2], all_logits=True))
    torch.testing.assert_close(logits, checkpoint.hf_logits(ids), atol=TOL, rtol=0)
