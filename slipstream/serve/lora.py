"""LoRA adapters as served models: `--lora-modules name=path`, and adding or dropping adapters
at run time (`POST /v1/load_lora_adapter`, `POST /v1/unload_lora_adapter`).

An adapter's name is a model name: it shows in /v1/models and a request picks it with its
`model` field. Each adapter is read and checked here before it is listed, so a bad one is a 400
naming the problem and the engine never sees it. Ids count up and are never reused, so an
adapter loaded again under an old name is never confused with the one the engine cached.
"""
from __future__ import annotations

import asyncio
import itertools

import torch
from fastapi import FastAPI
from fastapi.responses import PlainTextResponse, Response

from slipstream.config import EngineConfig
from slipstream.lora.adapter import load_adapter
from slipstream.lora.request import LoRARequest
from slipstream.serve.errors import APIError
from slipstream.serve.protocol import StrictModel


class LoadLoRAAdapterRequest(StrictModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(StrictModel):
    lora_name: str
    lora_int_id: int | None = None


def parse_lora_modules(entries: list[str] | None) -> list[tuple[str, str]]:
    """`name=path` entries of --lora-modules -> (name, path); ValueError for a bad entry."""
    pairs = []
    for entry in entries or []:
        name, sep, path = entry.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules takes NAME=PATH entries, got {entry!r}")
        pairs.append((name, path))
    return pairs


class LoRARegistry:
    """The adapters a server offers, by name."""

    def __init__(self, config: EngineConfig, base_name: str):
        self.config = config
        self.base_name = base_name
        self._by_name: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def get(self, name: str | None) -> LoRARequest | None:
        return self._by_name.get(name) if name is not None else None

    @property
    def names(self) -> list[str]:
        return list(self._by_name)

    def add(self, name: str, path: str) -> LoRARequest:
        """Check the adapter against the model and list it; ValueError says what is wrong."""
        if not name or name == self.base_name or name in self._by_name:
            raise ValueError(f"the model name {name!r} is taken" if name else
                             "lora_name must not be empty")
        lora = self.config.lora
        load_adapter(0, path, self.config.model, lora.max_lora_rank, torch.float32)
        request = LoRARequest(name, next(self._ids), path)
        self._by_name[name] = request
        return request

    def remove(self, name: str) -> LoRARequest:
        if name not in self._by_name:
            raise KeyError(name)
        return self._by_name.pop(name)


def add_lora_routes(app: FastAPI, registry: LoRARegistry | None) -> None:
    """The load / unload routes (behind the API key like every route but /health)."""

    def need_registry() -> LoRARegistry:
        if registry is None:
            raise APIError("this server was started without --enable-lora", 400,
                           code="lora_disabled")
        return registry

    @app.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
    async def load_lora_adapter(req: LoadLoRAAdapterRequest) -> Response:
        reg = need_registry()
        try:
            await asyncio.to_thread(reg.add, req.lora_name, req.lora_path)
        except ValueError as exc:
            raise APIError(str(exc), 400, param="lora_path", code="invalid_lora_adapter") from exc
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
    async def unload_lora_adapter(req: UnloadLoRAAdapterRequest) -> Response:
        reg = need_registry()
        known = reg.get(req.lora_name)
        if known is None or (req.lora_int_id is not None and req.lora_int_id != known.lora_int_id):
            raise APIError(f"no LoRA adapter named {req.lora_name!r}", 404, param="lora_name",
                           code="lora_not_found")
        reg.remove(req.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")
