"""`Adapters`: the lifecycle of the LoRA adapters an engine serves.

    add ─ loaded ─ remove ─ unloading: refused to new requests ─ no live request uses it ─ dropped

A request running under an adapter finishes under it; an unloading adapter added again is taken
back. The weights live in the model runner's `LoraAdapters` (None: this worker serves none).
"""
from collections.abc import Callable

from pdserve.common.errors import ConfigError, InvalidRequestError
from pdserve.engine.loading.lora_files import LoraCheckpoint


class Adapters:
    """Which adapters are loaded or unloading; `in_use` names those live requests run under."""

    def __init__(self, runner, in_use: Callable[[], set[int | None]]) -> None:
        self._runner = runner
        self._in_use = in_use
        self._unloading: set[int] = set()

    def add(self, checkpoint: LoraCheckpoint) -> None:
        """Load an adapter (ConfigError, changing nothing, when it cannot be); one being unloaded
        is taken back."""
        if self._runner.lora is None:
            raise ConfigError("enable_lora", False, "this worker serves no LoRA adapters (start it with --enable-lora)")
        self._runner.lora.add(checkpoint)
        self._unloading.discard(checkpoint.lora_id)

    def remove(self, lora_id: int) -> None:
        """New requests for the adapter are refused from now on; its weights go once no live
        request uses them."""
        if self._runner.lora is not None and lora_id in self._runner.lora:
            self._unloading.add(lora_id)
            self.drop_unused()

    def drop_unused(self) -> None:
        """Drop the weights of each unloading adapter no live request uses any more."""
        if not self._unloading:
            return
        in_use = self._in_use()
        for lora_id in self._unloading - in_use:
            self._runner.lora.remove(lora_id)
        self._unloading &= in_use

    def check_servable(self, lora_id: int | None) -> None:
        """InvalidRequestError for a request naming an adapter not loaded, or unloading."""
        loras = self._runner.lora
        if lora_id is not None and (loras is None or lora_id not in loras or lora_id in self._unloading):
            raise InvalidRequestError(f"LoRA adapter {lora_id} is not loaded on this worker", "model")
