"""A worker's LoRA adapters by name: loaded at start (`--lora-modules`) or at runtime.

An adapter loaded at runtime must lie in one of the worker's `--lora-dir` folders once every
link is resolved (none given: runtime loads are refused), and its files must not be larger
than an adapter of this model at `--max-lora-rank` can be; neither is read otherwise, and the
refusal names neither what exists nor what does not.

The engine knows adapters by id (a digest of their files); names are what requests and
operators use. Two names may share one id (the same files): the weights stay while any name
refers to them. Every change is made on the engine thread, between steps, and published in
the worker's `ModelInfo`, which the router and KV peers read.
"""
import asyncio
import contextlib
import logging
import os
from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager
from pathlib import Path

from pdserve.common.errors import ConfigError, InvalidRequestError, UnknownLoraAdapterError
from pdserve.common.stats import LoraAdapterInfo
from pdserve.engine.loading.lora_files import CONFIG_FILE, WEIGHTS_FILE, read_lora_checkpoint
from pdserve.worker.async_engine import ThreadedEngine

log = logging.getLogger(__name__)
MAX_NAME_CHARS = 256
MAX_CONFIG_BYTES = 1 << 20  # adapter_config.json


class LoraRegistry:
    """Implements `rpc.lora_service.LoraControl` for one worker."""

    def __init__(self, engine: ThreadedEngine, roots: Sequence[str] = ()) -> None:
        self._engine = engine
        self._roots = tuple(Path(os.path.realpath(root)) for root in roots)
        self._adapters: dict[str, LoraAdapterInfo] = {}
        self._lock = asyncio.Lock()  # one change at a time: a load reads files before it adds
        # What a load or unload passes first, as every request does (admission.entry_of): refused
        # while the worker drains or its engine is wedged. None: nothing (a worker not serving yet).
        self.entry: Callable[[], AbstractAsyncContextManager] = contextlib.nullcontext

    @property
    def is_enabled(self) -> bool:
        return self._engine.engine.runner.lora is not None

    def lora_ids(self) -> frozenset[int]:
        return frozenset(a.lora_id for a in self._adapters.values())

    def load_at_start(self, modules: tuple[tuple[str, str], ...]) -> None:
        """`--lora-modules` (name, path) pairs, before the engine thread starts; ConfigError stops the worker."""
        for name, path in modules:
            checkpoint = read_lora_checkpoint(path)
            self._engine.engine.add_lora(checkpoint)
            self._adapters[name] = LoraAdapterInfo(name, checkpoint.lora_id, checkpoint.path)
            log.info("LoRA adapter %r loaded from %s (id %d, rank %d)", name, path, checkpoint.lora_id, checkpoint.rank)
        self._publish()

    async def load(self, name: str, path: str) -> LoraAdapterInfo:
        """Load `path` under `name`. InvalidRequestError naming the field when it cannot be."""
        self._check_enabled()
        if not name or len(name) > MAX_NAME_CHARS or not name.isprintable():
            raise InvalidRequestError(f"lora_name must be 1 to {MAX_NAME_CHARS} printable characters", "lora_name")
        if name == self._engine.info().model_name:
            raise InvalidRequestError(f"lora_name {name!r} is the base model's name", "lora_name")
        folder = self._confined(path)
        async with self.entry(), self._lock:
            try:
                checkpoint = await asyncio.to_thread(read_lora_checkpoint, folder)
            except ConfigError as exc:
                raise InvalidRequestError(str(exc), "lora_path") from None
            loaded = self._adapters.get(name)
            if loaded is not None and loaded.lora_id != checkpoint.lora_id:
                raise InvalidRequestError(f"a LoRA adapter named {name!r} is loaded already, from other files "
                                          f"({loaded.path}); unload it first", "lora_name")
            try:
                await self._engine.add_lora(checkpoint)
            except ConfigError as exc:
                raise InvalidRequestError(str(exc), "lora_path") from None
            adapter = LoraAdapterInfo(name, checkpoint.lora_id, checkpoint.path)
            self._adapters[name] = adapter
            self._publish()
        log.info("LoRA adapter %r loaded from %s (id %d, rank %d)", name, path, adapter.lora_id, checkpoint.rank)
        return adapter

    async def unload(self, name: str) -> None:
        """UnknownLoraAdapterError when no adapter has that name."""
        self._check_enabled()
        async with self.entry(), self._lock:
            adapter = self._adapters.pop(name, None)
            if adapter is None:
                raise UnknownLoraAdapterError(f"no LoRA adapter named {name!r} is loaded")
            self._publish()
            if adapter.lora_id not in self.lora_ids():
                await self._engine.remove_lora(adapter.lora_id)
        log.info("LoRA adapter %r unloaded", name)

    def _confined(self, path: str) -> Path:
        """`path` resolved, when it lies in a `--lora-dir` folder and its files are not too
        large to be an adapter of this model; InvalidRequestError otherwise."""
        if not self._roots:
            raise InvalidRequestError("this worker loads no adapters at runtime: start it with --lora-dir "
                                      "naming the folders adapters may be loaded from", "lora_path")
        folder = Path(os.path.realpath(path))
        limits = ((CONFIG_FILE, MAX_CONFIG_BYTES), (WEIGHTS_FILE, self._engine.engine.runner.lora.max_weights_bytes))
        files = [Path(os.path.realpath(folder / name)) for name, _ in limits]  # a file may be a link too
        if not all(any(p.is_relative_to(root) for root in self._roots) for p in (folder, *files)):
            raise InvalidRequestError("lora_path is not in a --lora-dir folder of this worker", "lora_path")
        for file, (name, limit) in zip(files, limits):
            with contextlib.suppress(OSError):  # a missing file is reported when the adapter is read
                if file.stat().st_size > limit:
                    raise InvalidRequestError(f"{name} is larger than an adapter of this model can be "
                                              f"({limit} bytes at --max-lora-rank)", "lora_path")
        return folder

    def _check_enabled(self) -> None:
        if not self.is_enabled:
            raise InvalidRequestError("LoRA adapters are not enabled on this worker (start it with --enable-lora)",
                                      "lora_name")

    def _publish(self) -> None:
        self._engine.set_lora_adapters(tuple(sorted(self._adapters.values(), key=lambda a: a.name)))
