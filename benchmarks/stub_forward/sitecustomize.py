"""A benchmark's stub of the model forward, for processes that have this folder first on PYTHONPATH.

Python imports `sitecustomize` at start; this one adds an import hook that, once
`pdserve.engine.model.runner` is imported, replaces `ModelRunner.forward` with one that returns
fixed logits (made once per row count): every logit row is 0 but for `PDSERVE_STUB_TOKEN_ID`
(10.0 there), so greedy decoding picks that token at every step and the worker's cost is all
serving (scheduling, KV bookkeeping, sampling, detokenizing, the RPCs), none of it the model. A row per chunk as the
runner gives them: one for `needs_logits`, one per token for `all_logits`, none otherwise.

Nothing of the package is changed: `benchmarks/serving_overhead.py` puts this folder on its
workers' PYTHONPATH, so a tree checked out at any commit whose runner has
`forward(batch: ForwardBatch) -> ForwardOutput` is stubbed the same way. The hook writes one
line to stderr naming the module it stubbed, which the benchmark checks in each worker's log.
"""
import importlib.abc
import importlib.machinery
import os
import sys

RUNNER_MODULE = "pdserve.engine.model.runner"
STUB_LINE = "pdserve benchmark stub: fixed-logits forward in"


def _install(runner) -> None:
    import torch

    token_id = int(os.environ.get("PDSERVE_STUB_TOKEN_ID", "0"))

    made: dict[int, torch.Tensor] = {}  # the logits of R rows, made once: the stub costs no CPU per step

    @torch.inference_mode()
    def forward(self, batch):
        counts = [len(c.token_ids) if c.all_logits else int(c.needs_logits) for c in batch.chunks]
        num_rows = sum(counts)
        if num_rows not in made:
            logits = torch.zeros(num_rows, self.config.vocab_size, dtype=torch.float32, device=self.device)  # (R, vocab)
            logits[:, token_id] = 10.0
            made[num_rows] = logits
        return runner.ForwardOutput(list(torch.split(made[num_rows], counts)))

    runner.ModelRunner.forward = forward
    print(f"{STUB_LINE} {runner.__file__} (token {token_id})", file=sys.stderr, flush=True)


class _StubbingLoader(importlib.abc.Loader):
    """The runner module's own loader, and the stub installed once the module has run."""

    def __init__(self, inner: importlib.abc.Loader) -> None:
        self._inner = inner

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module) -> None:
        self._inner.exec_module(module)
        _install(module)

    def __getattr__(self, name: str):  # get_source and the like, for tracebacks
        return getattr(self._inner, name)


class _RunnerFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != RUNNER_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _StubbingLoader(spec.loader)
        return spec


sys.meta_path.insert(0, _RunnerFinder())
