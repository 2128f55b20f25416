"""The native kernels of each ISA level this CPU runs, for tests: a module of its own (not
conftest) so tests import it by a name no other test folder uses."""
import pytest
import torch

from pdserve.engine.model.native import cpu_levels, load_level
from pdserve.engine.model.native_forward import pack, packs_weights, weight_form

# Every level this CPU runs: a test parametrized by it runs once per level, and a level the CPU
# lacks is not a parameter at all (its kernels could not run here; test_native_levels.py shows it
# is refused and never chosen).
LEVELS_HERE = cpu_levels()


def level_module(level: str):
    """The prebuilt kernels of `level`; a missing build is a failure, not a skip."""
    return load_level(level)


def bf16_matrix(native, w: torch.Tensor) -> tuple[torch.Tensor, int | None]:
    """`w` in the form `native`'s level multiplies bf16 matrices in, with the width to pass
    `NativeModel.linear` (panels need it; None otherwise)."""
    form = weight_form(native, torch.bfloat16)
    if form == "panels":
        return native.to_panels(w), w.shape[0]
    if form == "onednn":
        return pack(w), None
    pytest.fail(f"level {native.LEVEL}: bf16 matrices should be packed, not {form}")


# The levels here that multiply bf16 matrices on oneDNN's packing (the AVX-512 levels; the AVX2
# level packs panels of its own).
ONEDNN_LEVELS = tuple(level for level in LEVELS_HERE if level != "avx2" and packs_weights(torch.bfloat16))
